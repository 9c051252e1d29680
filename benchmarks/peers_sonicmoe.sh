#!/usr/bin/env bash
# mokgen against SonicMoE on the GPU machine (issue #17), in the two back-to-back device calls
# of ../shared/tools/peers/README.md (its CuTe DSL wheel is larger than one call carries):
#   call 1, carry [".peersA"]:                         bash benchmarks/peers_sonicmoe.sh stage
#   call 2, carry [".peersB", ".kcache"] (and .peersC: below): bash benchmarks/peers_sonicmoe.sh run [shapes]
#   (PEERS_ARGS="--sustained 2": also each layer back to back at the power cap, the
#   *_sustained_* columns)
#   more calls while the machine is warm (within ~30 s): run [other shapes] reuses the install
#   peaks [shapes] instead of run: benchmarks/peak_phases.py (where each layer's step peaks,
#   and what is live there; default qwen3-30b-a3b) on the same install
#   stack [shapes] instead of run: benchmarks/replay_cost.py, SonicMoE's layers stacked as a
#   model stacks them (L = 1, 4 on the same x) beside mokgen's default (keep_h) and
#   h-in-the-ring layers (default qwen3-30b-a3b; its mokgen kernels prebuilt with
#   replay_cost.py --prebuild)
#   two GPUs (nvidia-h200-x2): run2 SHAPES0 SHAPES1 instead of run: each list on its own GPU
#   at once (the JIT is CPU work: two shapes for the wall time of one), the rows merged with
#   benchmarks/results/peers_sonicmoe.json's into $OUT/peers_sonicmoe.json
# (`bash ../shared/tools/peers/fetch.sh` here makes .peersA/.peersB.) Call 2 installs and runs
# benchmarks/peers_sonicmoe.py (shapes: a comma list, default all five). SonicMoE's first
# call JIT-compiles for minutes (2026-12-01: forward 130 s, backward 5+ min); QuACK keeps the
# compiled kernels as .o files in a file cache ($QUACK_CACHE_DIR, default
# /tmp/$USER/quack_cache) keyed by its sources, not by the shape: a later process on the same
# warm machine built every shape in ~6 s. `run` points that cache at .peersC/quack_cache and
# returns it as $OUT/quack_cache.tgz: unpack it into .peersC here and carry .peersC with
# .peersB, and a fresh machine skips the JIT too.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOKGEN_CACHE=${MOKGEN_CACHE:-$PWD/.kcache}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
case "${1:-}" in
  stage)
    mkdir -p /tmp/peers-wheels && cp .peersA/part.* /tmp/peers-wheels/ && ls /tmp/peers-wheels | wc -l
    ;;
  run|run2|peaks|stack)
    W=/tmp/peers-wheels
    if [ ! -d /tmp/peers/sonicmoe ]; then  # a later call on the same warm machine reuses it
      [ -d "$W" ] || { echo "no $W: run 'stage' in the call right before"; exit 2; }
      cat "$W"/part.* .peersB/part.* > "$W/$(cat .peersB/big.name)" && rm "$W"/part.*
      python3 -m pip install -q --no-index --no-deps --target /tmp/peers "$W"/*.whl \
        .peersB/*.whl || exit 3
    fi
    export PYTHONPATH=/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/python_packages:$PYTHONPATH
    export QUACK_CACHE_DIR=${QUACK_CACHE_DIR:-$PWD/.peersC/quack_cache}
    mkdir -p "$QUACK_CACHE_DIR"
    echo "QuACK cache: $(ls "$QUACK_CACHE_DIR" | wc -l) entries before the run"
    if [ "$1" = stack ]; then
      timeout "${RUN_TIMEOUT:-500}" python3 benchmarks/replay_cost.py --out "$OUT" \
        --shapes "${2:-qwen3-30b-a3b}" \
        --variants "${VARIANTS:-pull+keep_h=false,pull,sonicmoe}" ${STACK_ARGS:-} 2>&1 \
        | tee "$OUT/replay_cost_sonicmoe.log" | tail -12
    elif [ "$1" = peaks ]; then
      timeout "${RUN_TIMEOUT:-500}" python3 benchmarks/peak_phases.py --out "$OUT" \
        ${2:+--shapes "$2"} 2>&1 | tee "$OUT/peak_phases.log" | tail -60
    elif [ "$1" = run ]; then
      timeout "${RUN_TIMEOUT:-500}" python3 benchmarks/peers_sonicmoe.py --out "$OUT" \
        ${2:+--shapes "$2"} ${PEERS_ARGS:-} 2>&1 | tee "$OUT/peers_sonicmoe.log" | tail -20
    else
      for g in 0 1; do
        s=$([ $g = 0 ] && echo "${2:?run2 SHAPES0 SHAPES1}" || echo "${3:?run2 SHAPES0 SHAPES1}")
        CUDA_VISIBLE_DEVICES=$g timeout "${RUN_TIMEOUT:-500}" python3 benchmarks/peers_sonicmoe.py \
          --out "$OUT/gpu$g" --shapes "$s" > "$OUT/peers_sonicmoe_gpu$g.log" 2>&1 &
      done
      wait
      tail -n 4 "$OUT"/peers_sonicmoe_gpu*.log
      python3 benchmarks/peers_sonicmoe.py --out "$OUT" --merge \
        benchmarks/results/peers_sonicmoe.json $(ls "$OUT"/gpu*/peers_sonicmoe.json) | tail -8
    fi
    tar -czf "$OUT/quack_cache.tgz" -C "$(dirname "$QUACK_CACHE_DIR")" \
      "$(basename "$QUACK_CACHE_DIR")" && ls -la "$OUT/quack_cache.tgz"
    ;;
  *)
    echo "usage: $0 stage | run [shapes] | peaks [shapes] | stack [shapes] | run2 shapes0 shapes1"
    exit 2
    ;;
esac
