# session 31 call 3 (carry .kcache/s31b.pkl: plans of the files below): the rest of the GPU
# suite's bf16 files at the head (half B without fp8, which keeps the producer's own decode)
# and test_gpu_trace with its order check mended (the scheduler: Pop may precede Got)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOKGEN_CACHE=$PWD/.kcache TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
timeout 150 python3 benchmarks/collect_kernels.py .kcache/s31b.pkl 2>&1 | tail -1
timeout 330 python3 -m pytest -q -m gpu -o faulthandler_timeout=120 tests/test_gpu_trace.py \
  tests/test_gpu_prologue.py tests/test_gpu_directions.py tests/test_gpu_reliability.py \
  tests/test_gpu_transformers.py > $OUT/pytest_b.log 2>&1
grep "^FAILED\|^ERROR" $OUT/pytest_b.log | head; tail -c 600 $OUT/pytest_b.log
