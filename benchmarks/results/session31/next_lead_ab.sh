# next session (prepared in session 31; carry .build/kc .build/ab/lead): take-lead (f5fa9e2,
# the scheduler takes the next task 12 slices before the current one's end) against main
# (its kernels prebuilt at ba2430b), whole layers at the power cap in alternating processes
# (traced slices: next_lead_trace.sh).
# Kernels of both trees prebuilt in session 31 (prebuild_models.py, trace.py --prebuild);
# main's in .build/kc (if gone: MOKGEN_CACHE=$PWD/.build/kc python benchmarks/prebuild_models.py
# mixtral-8x22b,qwen3-30b-a3b,qwen3-235b-a22b 1 4096, here at main; the lead tree likewise).
export PYTHONPATH=$PWD TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
ARGS="--sustained 2" RUN_TIMEOUT=150 bash benchmarks/ab_models.sh lead \
  mixtral-8x22b,qwen3-30b-a3b,qwen3-235b-a22b 1 4096 2>&1 | tail -12
