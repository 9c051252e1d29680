# session 28 call 3 (carry .peersB, .peersC; right after call 2): the five peers rows at the head
QUACK_CACHE_DIR=$PWD/.peersC/quack_cache MOKGEN_CACHE=/tmp/kc28 RUN_TIMEOUT=560 \
  bash benchmarks/peers_sonicmoe.sh run
