#!/usr/bin/env bash
# Here, before a device call: the other tree of an A/B (benchmarks/ab_trace.sh, ab_models.sh,
# ab_outputs.py) made from this tree's HEAD plus a patch, and both trees' traced kernels of
# the given slices prebuilt into their caches (this tree .build/kc, the other
# .build/ab/NAME/kc), so the call carries .build and builds nothing:
#   bash benchmarks/prepare_ab.sh NAME PATCH "SHAPE EP N" ...
#   e.g. bash benchmarks/prepare_ab.sh lend2 benchmarks/results/session11/lend_stage_v2.patch \
#        "mixtral-8x22b 1 4096" "qwen3-30b-a3b 1 4096"
# then, carrying .build: MOKGEN_COMMIT=<sha> bash benchmarks/ab_trace.sh NAME "SHAPE EP N" ...
# The other tree's GPU tests on the device: (cd .build/ab/NAME && MOKGEN_CACHE=$PWD/kc
# python3 -m pytest -m gpu tests/...); their kernels build there unless collected here
# (benchmarks/collect_kernels.py, run from that tree).
set -euo pipefail
NAME=${1:?usage: prepare_ab.sh NAME PATCH "SHAPE EP N" ...}
PATCH=$(realpath "${2:?patch}")
shift 2
ROOT=$PWD
OTHER=$ROOT/.build/ab/$NAME
[ "$NAME" != base ] || { echo "NAME base is this tree's label"; exit 2; }
rm -rf "$OTHER"
mkdir -p "$OTHER" "$ROOT/.build/kc"
git -C "$ROOT" archive HEAD mokgen benchmarks tests pyproject.toml | tar -x -C "$OTHER"
rm -rf "$OTHER/benchmarks/results"  # results stay in this tree; the copy travels with .build
patch -s -p1 -d "$OTHER" < "$PATCH"  # (git apply there would patch this tree: .build is in it)
for slice in "$@"; do
  (cd "$ROOT" && MOKGEN_CACHE=$ROOT/.build/kc python3 benchmarks/trace.py $slice --prebuild)
  (cd "$OTHER" && PYTHONPATH=$OTHER MOKGEN_CACHE=$OTHER/kc python3 benchmarks/trace.py $slice \
    --prebuild)
done
du -sh "$ROOT/.build"
