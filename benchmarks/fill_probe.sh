#!/usr/bin/env bash
# The gathered fill probed in one device call (benchmarks/NOTES.md, sessions 13 and 14):
# benchmarks/fill_bench.py (the ring alone, by fill mechanism; FILL_BENCH=0 skips it), then
# traces with the ring's fill / drain words (trace.cuh kTrFillWait, kTrFillIssue,
# kTrFullWait) of the slices listed below, then the GPU trace test (TRACE_TEST=0 skips it).
#   here:   PREBUILD=1 MOKGEN_CACHE=$PWD/.build/kq bash benchmarks/fill_probe.sh
#           (then carry that cache and .build/fill_bench.cubin: .build/kc is past the limit)
#   device: MOKGEN_CACHE=$PWD/.build/kq MOKGEN_COMMIT=<sha> bash benchmarks/fill_probe.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOKGEN_CACHE=${MOKGEN_CACHE:-$PWD/.build/kc}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# session 14: no_mma (the mainloops without their wgmma) says whether the tensor core's
# shared-memory reads slow the gathered fill; session 13's slices were gather, one_waiter
# (--also gather_one_waiter), copied and Mixtral-8x22B ep 1 N 4096
slices=("gather|qwen3-30b-a3b 1 8192|--plan dispatch=gather"
        "gather_nomma|qwen3-30b-a3b 1 8192|--plan dispatch=gather --also no_mma"
        "inorder_nomma|qwen3-30b-a3b 1 8192|--plan dispatch=gather --also no_mma,gather_in_order"
        "copied|qwen3-30b-a3b 1 8192|" "copied_nomma|qwen3-30b-a3b 1 8192|--also no_mma")
if [ -n "${PREBUILD:-}" ]; then
  python3 benchmarks/fill_bench.py --prebuild | tail -2
  for s in "${slices[@]}"; do
    IFS='|' read -r tag slice extra <<< "$s"
    python3 benchmarks/trace.py $slice $extra --prebuild | tail -1
  done
  exit 0
fi
if [ "${FILL_BENCH:-1}" = 1 ]; then
  timeout 120 python3 benchmarks/fill_bench.py > "$OUT/fill_bench.log" 2>&1
  echo "== fill_bench: exit $?"; sed -n '/^| mode/,$p' "$OUT/fill_bench.log"
fi
for s in "${slices[@]}"; do
  IFS='|' read -r tag slice extra <<< "$s"
  timeout 90 python3 benchmarks/trace.py $slice $extra --out "$OUT/$tag" > "$OUT/trace_$tag.log" 2>&1
  echo "== $tag: exit $?, $(grep -h 'ms (event' "$OUT/trace_$tag.log" | cut -d: -f2)"
  grep -h "^| kind\|^| Wgrad\|^| Dgrad\|^| Dx\|^| GateUp\|^| Down" "$OUT/trace_$tag.log" | cut -c1-220
done
if [ "${TRACE_TEST:-1}" = 1 ]; then
  timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_trace.py > "$OUT/pytest_trace.log" 2>&1
  echo "== test_gpu_trace: $(tail -1 "$OUT/pytest_trace.log")"
fi
