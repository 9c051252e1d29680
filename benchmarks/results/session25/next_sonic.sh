# next session, two calls back to back (session 24's call3_stage.sh first: carry .peersA and
# .kc24), then this one (carry .peersB and .peersC: the QuACK cache of all five shapes, from
# session 24's call 4, so no JIT): which of SonicMoE's GEMM launches is which, against our
# kernels, one Qwen3-30B layer (replay_cost --kernel-table at L 1 prints the kernels in launch
# order), our backward per phase (trace.py, its traced kernels prebuilt into .kc25 in
# session 24 and left on the machine by next_tests.sh's call), then the five peers rows.
QUACK_CACHE_DIR=$PWD/.peersC/quack_cache MOKGEN_CACHE=$PWD/.kc24 VARIANTS=pull,sonicmoe \
  STACK_ARGS="--layers 1 --iters 5 --kernel-table 20" RUN_TIMEOUT=200 \
  bash benchmarks/peers_sonicmoe.sh stack
PYTHONPATH=$PWD MOKGEN_CACHE=$PWD/.kc25 timeout 120 python3 benchmarks/trace.py qwen3-30b-a3b 1 \
  8192 --out $OUT 2>&1 | tail -n 45
QUACK_CACHE_DIR=$PWD/.peersC/quack_cache MOKGEN_CACHE=$PWD/.kc24 RUN_TIMEOUT=300 \
  bash benchmarks/peers_sonicmoe.sh run
