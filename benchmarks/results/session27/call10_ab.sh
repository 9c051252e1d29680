# session 27, call 10 (one H200; carry .build/kc and .build/ab/old): the staged gate/up and down rows
# against the head's code (old = 5219431's kernel sources, the same as 1f4c34c's), traced on
# Qwen3-30B and by gather_ab ABBA on four shapes. Prediction (after call 8: Down 2.5 -> 2.1 us at +10% clock): GateUp epilogue
# 4.0 -> ~3 us a tile, forward +3..5% on Qwen3-30B / OLMoE, +1..3% on the larger two.
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
SLICE_TIMEOUT=60 bash benchmarks/ab_trace.sh old "qwen3-30b-a3b 1 8192" > $OUT/ab_trace_old.log 2>&1
el "ab_trace old"; grep -E "^==|^### forward|^\| (Down|GateUp)" $OUT/ab_trace_old.log | cut -c1-110
mkdir -p $OUT/g_old
OUT=$OUT/g_old bash benchmarks/ab_gather.sh old \
  qwen3-30b-a3b,olmoe-1b-7b,qwen3-235b-a22b,mixtral-8x7b > $OUT/ab_gather_old.log 2>&1
el "ab_gather old"; cat $OUT/ab_gather_old.log
