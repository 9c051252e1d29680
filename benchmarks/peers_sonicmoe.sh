#!/usr/bin/env bash
# mokgen against SonicMoE on the GPU machine (issue #17), in the two back-to-back device calls
# of ../shared/tools/peers/README.md (its CuTe DSL wheel is larger than one call carries):
#   call 1, carry [".peersA"]:                         bash benchmarks/peers_sonicmoe.sh stage
#   call 2, carry [".peersB", ".kcache", ".peers-jit"]: bash benchmarks/peers_sonicmoe.sh run [shapes]
#   more calls while the machine is warm (within ~30 s): run [other shapes] reuses the install
# (`bash ../shared/tools/peers/fetch.sh` here makes .peersA/.peersB.) Call 2 installs, points
# CuTe DSL's compile cache (CUTE_DSL_CACHE_DIR) at a copy of a carried .peers-jit/ if there is
# one, runs benchmarks/peers_sonicmoe.py (shapes: a comma list, default all five; SonicMoE
# JIT-compiles 1.5-3 min per shape without a cache) and leaves the cache in $OUT/peers-jit for
# the next session to carry as .peers-jit/.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOKGEN_CACHE=${MOKGEN_CACHE:-$PWD/.kcache}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
case "${1:-}" in
  stage)
    mkdir -p /tmp/peers-wheels && cp .peersA/part.* /tmp/peers-wheels/ && ls /tmp/peers-wheels | wc -l
    ;;
  run)
    W=/tmp/peers-wheels
    if [ ! -d /tmp/peers/sonicmoe ]; then  # a later call on the same warm machine reuses it
      [ -d "$W" ] || { echo "no $W: run 'stage' in the call right before"; exit 2; }
      cat "$W"/part.* .peersB/part.* > "$W/$(cat .peersB/big.name)" && rm "$W"/part.*
      python3 -m pip install -q --no-index --no-deps --target /tmp/peers "$W"/*.whl \
        .peersB/*.whl || exit 3
    fi
    export PYTHONPATH=/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/python_packages:$PYTHONPATH
    export CUTE_DSL_CACHE_DIR=/tmp/cute-cache
    mkdir -p "$CUTE_DSL_CACHE_DIR"
    [ -d .peers-jit ] && cp -r .peers-jit/. "$CUTE_DSL_CACHE_DIR"/
    echo "== CuTe DSL cache: $(du -sh "$CUTE_DSL_CACHE_DIR" | cut -f1) before"
    timeout "${RUN_TIMEOUT:-500}" python3 benchmarks/peers_sonicmoe.py --out "$OUT" \
      ${2:+--shapes "$2"} 2>&1 | tee "$OUT/peers_sonicmoe.log" | tail -12
    echo "== CuTe DSL cache: $(du -sh "$CUTE_DSL_CACHE_DIR" | cut -f1) after"
    cp -r "$CUTE_DSL_CACHE_DIR" "$OUT/peers-jit"
    ;;
  *)
    echo "usage: $0 stage | run [shapes]"; exit 2
    ;;
esac
