# session 29 call 2 (carry .peersB, .peersC; right after call 1): the five peers rows at the
# head, with each layer also back to back for 2 s at the power cap (the *_sustained_* columns)
PEERS_ARGS="--sustained 2" QUACK_CACHE_DIR=$PWD/.peersC/quack_cache MOKGEN_CACHE=/tmp/kc29 \
  RUN_TIMEOUT=570 bash benchmarks/peers_sonicmoe.sh run
