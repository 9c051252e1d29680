# session 30 call 1: the gathered variants at the power cap (NOTES twenty-ninth, next item 1)
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv
PYTHONPATH=$PWD MOKGEN_CACHE=$PWD/.kc30g python3 benchmarks/gather_ab.py --out $OUT --sustained 2 \
  --variants pull,gather,fwd-gather --shapes qwen3-235b-a22b,mixtral-8x7b,sonicmoe-readme,qwen3-30b-a3b
