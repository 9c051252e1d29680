# session 30 call 5 (carry .kcache/bwd30.pkl): the final tree's backward GPU tests (the
# scheduling thread, BwdSchedule::launder), their kernels built first on every core
export PYTHONPATH=$PWD TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 MOKGEN_CACHE=/tmp/kc
timeout 60 python3 benchmarks/collect_kernels.py .kcache/bwd30.pkl 2>&1 | tail -1
timeout 290 python3 -m pytest -q -m gpu -o faulthandler_timeout=100 tests/test_gpu_backward.py \
  2>&1 | tail -6
