# session 29 call 3 (carry .kc29p): multicast pairs (GemmConfig.pair) in the forward: the GPU
# tests (pairs bitwise equal to the default forward, against the reference), then the layer
# with and without them, ABBA in one process, also back to back at the power cap
export PYTHONPATH=$PWD
timeout 200 python3 -m pytest -q -x tests/test_gpu_pair.py 2>&1 | tail -4
MOKGEN_CACHE=$PWD/.kc29p timeout 370 python3 benchmarks/gather_ab.py --out $OUT --sustained 2 \
  --variants pull,pull+gemm_fwd=128:256:4:false:false:false:true \
  --shapes qwen3-235b-a22b,mixtral-8x7b,sonicmoe-readme,qwen3-30b-a3b \
  2>&1 | grep -v Warn | tee $OUT/gather_ab.log | tail -16
