# next session (carry .build/kc .build/ab/lead): take-lead against main, traced slices: the
# Dgrad idle (session 30: 5.2 -> 8.5 SM-ms on Qwen3-30B with the take at a task's start) and
# Mixtral-8x22B's phases' tails. Trace kernels of both trees prebuilt in session 31.
export PYTHONPATH=$PWD TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
SLICE_TIMEOUT=120 bash benchmarks/ab_trace.sh lead "mixtral-8x22b 1 4096" "qwen3-30b-a3b 1 8192" 2>&1 | tail -60
