# next session (prepared in session 31; carry .build/kc .build/ab/lead): take-lead (f5fa9e2,
# the scheduler takes the next task 12 slices before the current one's end) against main
# (bf9858b), whole layers at the power cap in alternating processes, then traced slices
# (Dgrad idle: session 30 saw 5.2 -> 8.5 SM-ms on Qwen3-30B with the take at a task's start).
# Kernels of both trees prebuilt in session 31 (prebuild_models.py, trace.py --prebuild);
# main's must sit in .build/kc: cp -r .build/ab/main/kc .build/kc if missing.
export PYTHONPATH=$PWD TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
ARGS="--sustained 2" RUN_TIMEOUT=150 bash benchmarks/ab_models.sh lead \
  mixtral-8x22b,qwen3-30b-a3b,qwen3-235b-a22b 1 4096 2>&1 | tail -12
SLICE_TIMEOUT=100 bash benchmarks/ab_trace.sh lead "mixtral-8x22b 1 4096" "qwen3-30b-a3b 1 8192" 2>&1 | tail -60
