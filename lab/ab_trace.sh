#!/usr/bin/env bash
# Two trees' kernels traced in one device call (lab/trace.py), slice by slice on one GPU:
# this tree (cache .build/kc) and another exported under .build/ab/NAME (its own cache
# .build/ab/NAME/kc), so a change is judged against its base in the same call. Made here by
# lab/prepare_ab.sh NAME PATCH... --trace "SHAPE EP N" (the tree and both trees' traced kernels);
# then, carrying .build:  MOKGEN_COMMIT=<sha> bash lab/ab_trace.sh NAME "SHAPE EP N" ...
# Results: $OUT/base/ and $OUT/NAME/ (trace JSON), the tables in $OUT/*.log, a summary last
# (each direction's SM clock first: traces of two trees compare per clock, not per ms).
set -uo pipefail
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
NAME=${1:?usage: ab_trace.sh NAME "SHAPE EP N" ...}
shift
ROOT=$PWD
OTHER=$ROOT/.build/ab/$NAME
[ -d "$OTHER" ] || { echo "no $OTHER: export the other tree there first"; exit 2; }
[ "$NAME" != base ] || { echo "NAME base is this tree's label: name the other tree otherwise"; exit 2; }
mkdir -p "$OUT/base" "$OUT/$NAME"
for slice in "$@"; do
  tag=${slice// /_}
  (cd "$ROOT" && PYTHONPATH=$ROOT MOKGEN_CACHE=$ROOT/.build/kc timeout ${SLICE_TIMEOUT:-150} \
    python3 lab/trace.py $slice --out "$OUT/base" > "$OUT/base_$tag.log" 2>&1)
  (cd "$OTHER" && PYTHONPATH=$OTHER MOKGEN_CACHE=$OTHER/kc timeout ${SLICE_TIMEOUT:-150} \
    python3 lab/trace.py $slice --out "$OUT/$NAME" > "$OUT/${NAME}_$tag.log" 2>&1)
  for side in base "$NAME"; do
    echo "== $side: $(grep -h 'ms (event' "$OUT/${side}_$tag.log" || tail -2 "$OUT/${side}_$tag.log")"
    grep -h "^###\|^| [A-Za-z]\|^clocks\|kernels:" "$OUT/${side}_$tag.log" | grep -v "^| kind" | cut -c1-240
  done
done
