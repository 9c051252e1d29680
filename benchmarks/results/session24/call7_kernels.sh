# session 24, call 7 (carry .peersB and .peersC; after call3_stage.sh, which carries .peersA
# and .kc24): which kernels SonicMoE runs faster than mokgen, Qwen3-30B, one layer.
QUACK_CACHE_DIR=$PWD/.peersC/quack_cache MOKGEN_CACHE=$PWD/.kc24 VARIANTS=pull,sonicmoe \
  STACK_ARGS="--layers 1 --iters 5 --kernel-table 16" RUN_TIMEOUT=200 \
  bash benchmarks/peers_sonicmoe.sh stack
