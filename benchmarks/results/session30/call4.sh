# session 30 call 4 (carry .build/kc, .kcache/collected.pkl): the final tree's GPU tests of
# the engine's two producer paths (the scheduling thread: bf16; the producer's own next_task:
# fp8), built first on every core; then #16's row at the power cap
export PYTHONPATH=$PWD TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
MOKGEN_CACHE=/tmp/kc timeout 130 python3 benchmarks/collect_kernels.py .kcache/collected.pkl 2>&1 | tail -1
MOKGEN_CACHE=/tmp/kc timeout 330 python3 -m pytest -q -m gpu -o faulthandler_timeout=100 \
  tests/test_gpu_pingpong.py tests/test_gpu_fp8.py tests/test_gpu_backward.py \
  tests/test_gpu_forward.py 2>&1 | tail -8
MOKGEN_CACHE=$PWD/.build/kc timeout 100 python3 benchmarks/models.py --models mixtral-8x22b,mixtral-8x7b \
  --ep 1 --tokens 4096 --sustained 2 --out $OUT 2>&1 | grep -v Warn | tail -6
