# session 29 call 6 (carry .kc29r): pairs multicast the down tiles' weight halves too (W2 maps
# of 128-row boxes): the GPU tests, then the A/B at the power cap on four shapes
export PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q -x tests/test_gpu_pair.py 2>&1 | tail -3
MOKGEN_CACHE=$PWD/.kc29r timeout 330 python3 benchmarks/gather_ab.py --out $OUT --sustained 2 \
  --variants pull,pull+gemm_fwd=128:256:4:false:false:false:true \
  --shapes qwen3-235b-a22b,mixtral-8x7b,sonicmoe-readme,qwen3-30b-a3b \
  2>&1 | grep -v Warn | tee $OUT/gather_ab.log | tail -12
