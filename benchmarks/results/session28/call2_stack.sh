# session 28 call 2 (carry .peersB, .peersC; right after call 1): one layer of each of the
# three shapes where #17 misses, mokgen's default beside SonicMoE, kernels in launch order
QUACK_CACHE_DIR=$PWD/.peersC/quack_cache MOKGEN_CACHE=/tmp/kc28 VARIANTS=pull,sonicmoe \
  STACK_ARGS="--layers 1 --iters 5 --kernel-table 24" RUN_TIMEOUT=540 \
  bash benchmarks/peers_sonicmoe.sh stack qwen3-235b-a22b,mixtral-8x7b,sonicmoe-readme
