# session 30 call 3 (carry .build): the scheduling thread at the power cap, whole layers:
# old (HEAD 0c4a81e, .build/ab/old) and new (this tree) in alternating processes, each model's
# forward and training step against autograd grouped_mm, synced and back to back for 2 s;
# then the engine-schedule GPU tests (ping-pong, signal warp, solo) of the new tree
export PYTHONPATH=$PWD TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
ARGS="--sustained 2" RUN_TIMEOUT=150 bash benchmarks/ab_models.sh old \
  mixtral-8x22b,qwen3-30b-a3b,qwen3-235b-a22b 1 4096 2>&1 | tail -12
MOKGEN_CACHE=/tmp/kt timeout 200 python3 -m pytest -q -m gpu -x -o faulthandler_timeout=120 \
  tests/test_gpu_pingpong.py 2>&1 | tail -4
