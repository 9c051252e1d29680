# session 32 call 1 (carry .build/kc .build/ab/lead): take-lead (aeb5ae0, rewritten this
# session: session 31's branch did not survive) against main (1473010), whole layers at the
# power cap in alternating processes; kernels of both trees prebuilt here
export PYTHONPATH=$PWD TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,clocks.sm,power.limit --format=csv,noheader
ARGS="--sustained 2" RUN_TIMEOUT=130 bash benchmarks/ab_models.sh lead \
  mixtral-8x22b,qwen3-30b-a3b,qwen3-235b-a22b 1 4096 2>&1 | tail -12
