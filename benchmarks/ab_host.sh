#!/usr/bin/env bash
# The host's share of a step (benchmarks/host_overhead.py) for this tree and another exported
# under .build/ab/NAME, in one device call, alternating trees per token count, so a host-side
# change is judged against its base on the same machine. Kernels are shared: both trees
# compile the same sources into one cache unless a header differs. Made here:
#   git archive BRANCH | tar -x -C .build/ab/NAME
# then, carrying .build/ab/NAME:  bash benchmarks/ab_host.sh NAME [TOKENS ...]   (default 4096 8192)
set -uo pipefail
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
export MOKGEN_CACHE=${MOKGEN_CACHE:-/tmp/mokgen-cache}
OUT=${OUT:-/tmp/out}
NAME=${1:?usage: ab_host.sh NAME [TOKENS ...]}
shift
[ $# -gt 0 ] || set -- 4096 8192
ROOT=$PWD
OTHER=$ROOT/.build/ab/$NAME
[ -d "$OTHER" ] || { echo "no $OTHER: export the other tree there first"; exit 2; }
mkdir -p "$OUT"
for n in "$@"; do
  for side in base "$NAME"; do
    tree=$([ "$side" = base ] && echo "$ROOT" || echo "$OTHER")
    (cd "$tree" && PYTHONPATH=$tree timeout ${HOST_TIMEOUT:-150} python3 benchmarks/host_overhead.py \
      --tokens "$n" > "$OUT/host_${side}_$n.txt" 2>&1)
    echo "== $side N $n: $(grep -h '^{"shape"' "$OUT/host_${side}_$n.txt" || tail -2 "$OUT/host_${side}_$n.txt")"
  done
done
