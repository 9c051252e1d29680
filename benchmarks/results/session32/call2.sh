# session 32 call 2 (carry .build/kc .build/ab/lead; trace kernels prebuilt here with
# trace.py --prebuild in both trees): take-lead against main, traced slices
export PYTHONPATH=$PWD TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
SLICE_TIMEOUT=120 OUT=$OUT bash benchmarks/ab_trace.sh lead "mixtral-8x22b 1 4096" "qwen3-30b-a3b 1 8192" 2>&1 | tail -70
