#!/usr/bin/env bash
# gather_ab.py's layers, two trees taking turns by process (ABBA: NAME, this tree, this tree,
# NAME), so a change's forward / training-step ratio is read against its base in one device
# call: this tree with cache .build/kc (or $BASE_KC), the other exported under
# .build/ab/NAME with its own cache .build/ab/NAME/kc (lab/prepare_ab.sh; prebuilt with
# `lab/gather_ab.py --prebuild --variants V --shapes S` in each tree). Carrying .build:
#   bash lab/ab_gather.sh NAME SHAPE[,SHAPE...] [VARIANTS (default pull)]
# or, once .build is past one call's carry, carrying .build/ab/NAME and a base cache of its
# own:  BASE_KC=$PWD/.kcX bash lab/ab_gather.sh NAME SHAPES VARIANTS
# (AB_ARGS="--sustained 2" adds gather_ab's back-to-back columns)
# Results: $OUT/ab_<i>_<side>/gather_ab.json and .log; each run's table printed as it ends.
set -uo pipefail
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
NAME=${1:?usage: ab_gather.sh NAME SHAPES [VARIANTS]}
SHAPES=${2:?usage: ab_gather.sh NAME SHAPES [VARIANTS]}
VARIANTS=${3:-pull}
ROOT=$PWD
OTHER=$ROOT/.build/ab/$NAME
[ -d "$OTHER" ] || { echo "no $OTHER: export the other tree there first"; exit 2; }
[ "$NAME" != base ] || { echo "NAME base is this tree's label: name the other tree otherwise"; exit 2; }
i=0
for side in "$NAME" base base "$NAME"; do
  i=$((i + 1))
  if [ "$side" = base ]; then tree=$ROOT; kc=${BASE_KC:-$ROOT/.build/kc}; else tree=$OTHER; kc=$OTHER/kc; fi
  (cd "$tree" && PYTHONPATH=$tree MOKGEN_CACHE=$kc timeout ${AB_TIMEOUT:-100} \
    python3 lab/gather_ab.py --variants "$VARIANTS" --shapes "$SHAPES" ${AB_ARGS:-} \
      --out "$OUT/ab_${i}_$side" > "$OUT/ab_${i}_$side.log" 2>&1)
  echo "== ab $i $side (rc $?)"
  grep "^| [a-z]" "$OUT/ab_${i}_$side.log"
done
