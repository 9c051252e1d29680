# session 28 call 5 (carry .kc28b): the forward's comm CTAs on the two big-T shapes (planner:
# Qwen3-235B 8 / 10, README shape 12 / 14) against 6 and 9, and the backward's at 8; ABBA
PYTHONPATH=$PWD MOKGEN_CACHE=$PWD/.kc28b timeout 500 python3 benchmarks/gather_ab.py --out $OUT \
  --variants pull,pull+comm_sms_fwd=6,pull+comm_sms_fwd=9,pull+comm_sms_bwd=8 \
  --shapes qwen3-235b-a22b,sonicmoe-readme 2>&1 | grep -v Warn | tee $OUT/gather_ab.log | tail -5
