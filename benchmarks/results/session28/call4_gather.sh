# session 28 call 4 (carry .kc28b): the gathered variants on the three big shapes, ABBA in one
# process; never measured above T 8192 (sessions 10-18: Qwen3-30B and OLMoE only)
PYTHONPATH=$PWD MOKGEN_CACHE=$PWD/.kc28b timeout 560 python3 benchmarks/gather_ab.py --out $OUT \
  --variants pull,gather,fwd-gather --shapes qwen3-235b-a22b,mixtral-8x7b,sonicmoe-readme \
  2>&1 | grep -v Warn | tee $OUT/gather_ab.log | tail -8
