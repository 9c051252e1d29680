# next session (carry .build/ab/lead .kcache/s31.pkl): take-lead's GPU tests, in its tree,
# kernels of the suite's collected plans built on every core first (142 s for 471 in session 31)
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
cd .build/ab/lead && export PYTHONPATH=$PWD MOKGEN_CACHE=/tmp/kl
timeout 200 python3 benchmarks/collect_kernels.py ../../../.kcache/s31.pkl 2>&1 | tail -1
timeout 330 python3 -m pytest -q -m gpu -x -o faulthandler_timeout=100 tests/test_gpu_pingpong.py \
  tests/test_gpu_trace.py tests/test_gpu_forward.py tests/test_gpu_backward.py 2>&1 | tail -5
