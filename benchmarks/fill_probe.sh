#!/usr/bin/env bash
# The gathered fill's floor probed in one device call (benchmarks/NOTES.md, session 13):
# benchmarks/fill_bench.py (the ring alone, by fill mechanism and producer warps), then the
# ring's fill / drain words of the trace (trace.cuh kTrFillWait, kTrFillIssue, kTrFullWait)
# for the gathered backward of Qwen3-30B ep 1 T 8192 (plain, and with one empty-barrier
# poller a producer warp: gather_one_waiter), its copied backward and Mixtral-8x22B ep 1
# N 4096, then the GPU trace test.
#   here:   PREBUILD=1 bash benchmarks/fill_probe.sh      (then carry .build/kc, .build/fill_bench.cubin)
#   device: MOKGEN_COMMIT=<sha> bash benchmarks/fill_probe.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOKGEN_CACHE=${MOKGEN_CACHE:-$PWD/.build/kc}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
slices=("gather|qwen3-30b-a3b 1 8192|--plan dispatch=gather"
        "one_waiter|qwen3-30b-a3b 1 8192|--plan dispatch=gather --also gather_one_waiter"
        "copied|qwen3-30b-a3b 1 8192|" "mixtral|mixtral-8x22b 1 4096|")
if [ -n "${PREBUILD:-}" ]; then
  python3 benchmarks/fill_bench.py --prebuild | tail -2
  for s in "${slices[@]}"; do
    IFS='|' read -r tag slice extra <<< "$s"
    python3 benchmarks/trace.py $slice $extra --prebuild | tail -1
  done
  exit 0
fi
timeout 120 python3 benchmarks/fill_bench.py > "$OUT/fill_bench.log" 2>&1
echo "== fill_bench: exit $?"; sed -n '/^| mode/,$p' "$OUT/fill_bench.log"
for s in "${slices[@]}"; do
  IFS='|' read -r tag slice extra <<< "$s"
  timeout 90 python3 benchmarks/trace.py $slice $extra --out "$OUT/$tag" > "$OUT/trace_$tag.log" 2>&1
  echo "== $tag: exit $?, $(grep -h 'ms (event' "$OUT/trace_$tag.log" | cut -d: -f2)"
  grep -h "^| kind\|^| Wgrad\|^| Dgrad\|^| Dx\|^| GateUp\|^| Down" "$OUT/trace_$tag.log" | cut -c1-220
done
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_trace.py > "$OUT/pytest_trace.log" 2>&1
echo "== test_gpu_trace: $(tail -1 "$OUT/pytest_trace.log")"
