# session 29 call 9 (carry .kc29m): Mixtral-8x22B ep 1 with multicast pairs in the forward,
# synced and at the power cap (against call 8's default row)
PYTHONPATH=$PWD MOKGEN_CACHE=$PWD/.kc29m timeout 150 python3 benchmarks/models.py \
  --models mixtral-8x22b --ep 1 --tokens 4096 --sustained 2 --gemm 128x256x4-pair \
  --gemm-bwd 128x256x4 --out $OUT 2>&1 | grep -v Warn | tail -8
