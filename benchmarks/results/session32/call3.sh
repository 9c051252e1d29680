# session 32 call 3 (no carry; main at 1473010): the two GPU test files not run at the head
# in session 31, side by side, kernels built inside the tests
export PYTHONPATH=$PWD TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 MOKGEN_CACHE=/tmp/kt
(timeout 280 python3 -m pytest -q -m gpu -o faulthandler_timeout=150 tests/test_gpu_transformers.py 2>&1 | tail -6) &
timeout 280 python3 -m pytest -q -m gpu -x -o faulthandler_timeout=150 tests/test_gpu_pingpong.py 2>&1 | tail -6; wait
# output: transformers 5 passed in 46.81s; pingpong 14 passed in 239.45s
