# session 30 call 2 (carry .build): the scheduling thread (GemmCfg::SCHEDULER, bf16 kernels):
# traced old (HEAD 0c4a81e, .build/ab/old) against new (this tree) on Qwen3-30B N 8192; then
# the forward and backward GPU tests of the new tree (their kernels build here)
export PYTHONPATH=$PWD TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
SLICE_TIMEOUT=120 bash benchmarks/ab_trace.sh old "qwen3-30b-a3b 1 8192" 2>&1 | tail -30
MOKGEN_CACHE=/tmp/kt timeout 330 python3 -m pytest -q -m gpu -x -o faulthandler_timeout=120 \
  tests/test_gpu_forward.py tests/test_gpu_backward.py 2>&1 | tail -6
