# session 27, call 6 (one H200): where the forward's epilogues go, by timing-only builds
# (carry .build/kp: their kernels). Profiles: fwd_sink_stores (routed gate/up + down: values
# computed, not stored), down_in_order (down rows in order, no table / weight loads),
# no_fwd_epilogues (no epilogue at all). Traced (trace.py), base twice around them.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOKGEN_CACHE=$PWD/.build/kp
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
run() {  # shape ep n tag [--also P]
  local tag=$4; shift 4
  timeout 120 python3 benchmarks/trace.py $SHAPE --out $OUT/t "$@" > $OUT/${NAME}_$tag.log 2>&1
  echo "== $NAME $tag: $(grep -h 'ms (event' $OUT/${NAME}_$tag.log | cut -c1-120)"
  grep -h "^### forward\|^| GateUp\|^| Down" $OUT/${NAME}_$tag.log | head -3 | cut -c1-130
}
SHAPE="qwen3-30b-a3b 1 8192"; NAME=q30
run x x x base; run x x x sink --also fwd_sink_stores; run x x x inorder --also down_in_order
run x x x noepi --also no_fwd_epilogues; run x x x base2
el q30
SHAPE="qwen3-235b-a22b 1 16384"; NAME=q235
run x x x base; run x x x sink --also fwd_sink_stores; run x x x inorder --also down_in_order
el q235
