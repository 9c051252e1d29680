#!/usr/bin/env bash
# The gathered backward's stage fills probed in one device call (benchmarks/NOTES.md, session
# 12, items 6 and 8). One slice, SHAPE EP N (default Qwen3-30B ep 1 T 8192) with
# dispatch="gather", is traced (benchmarks/trace.py) plain, with each diagnostic profile
# given (abi.PROFILES, e.g. gather_in_order, gather_one_waiter), and with 3 ring stages instead
# of 4 (how much a fill's latency matters). Prints each variant's per-phase table.
#   here:   PREBUILD=1 MOKGEN_CACHE=$PWD/.build/kc bash benchmarks/gather_probe.sh PROFILE ...
#   device: (carry .build) MOKGEN_COMMIT=<sha> bash benchmarks/gather_probe.sh PROFILE ...
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOKGEN_CACHE=${MOKGEN_CACHE:-$PWD/.build/kc}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
SLICE=${SLICE:-qwen3-30b-a3b 1 8192}
mkdir -p "$OUT"
variants=("" "--gemm-bwd 128x256x3")
for p in "$@"; do variants+=("--also $p"); done
for v in "${variants[@]}"; do
  tag=${v:-plain}; tag=${tag//--also /}; tag=${tag//--gemm-bwd /stages-}; tag=${tag// /_}
  if [ -n "${PREBUILD:-}" ]; then
    python3 benchmarks/trace.py $SLICE --plan dispatch=gather $v --prebuild | tail -1
    continue
  fi
  timeout ${SLICE_TIMEOUT:-90} python3 benchmarks/trace.py $SLICE --plan dispatch=gather $v \
    --out "$OUT/$tag" > "$OUT/probe_$tag.log" 2>&1
  echo "== $tag: exit $?, $(grep -h 'ms (event' "$OUT/probe_$tag.log" | cut -d: -f2)"
  grep -h "^### backward\|^| Wgrad\|^| Dgrad\|^| Dx\|^| GateUp" "$OUT/probe_$tag.log" | cut -c1-160
done
