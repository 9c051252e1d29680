#!/usr/bin/env bash
# Here, before a device call: the other tree of an A/B made from this tree's HEAD plus patches
# applied in order, exported under .build/ab/NAME (code only, no results), and both trees'
# kernels built into their caches (this tree .build/kc, the other .build/ab/NAME/kc), so the
# call carries .build and builds nothing. Every tree imports its own mokgen (PYTHONPATH).
#   bash lab/prepare_ab.sh NAME PATCH [PATCH ...] [--models M,M,.. EP TOKENS]
#        [--trace "SHAPE EP N"] ... [--gather SHAPES VARIANTS]
#   e.g. bash lab/prepare_ab.sh pad lab/patches/pad_half.patch \
#          --models mixtral-8x22b,qwen3-30b-a3b 1 4096 --trace "qwen3-30b-a3b 1 8192"
# --models: benchmarks/models.py's (and training_step.py's) layers; --trace: lab/trace.py's
# traced builds of a slice; --gather: lab/gather_ab.py's variants. Then, carrying .build:
#   bash lab/ab_models.sh NAME M,M,.. EP TOKENS / lab/ab_trace.sh NAME "SHAPE EP N" ... /
#   lab/ab_gather.sh NAME SHAPES VARIANTS
# The other tree's GPU tests on the device: (cd .build/ab/NAME && KERNELS=<its plan list>
# bash benchmarks/run_gpu.sh tests-a), the list collected in that tree here
# (python benchmarks/prebuild.py collect <list>), else its tests build one by one.
set -euo pipefail
NAME=${1:?usage: prepare_ab.sh NAME PATCH [PATCH ...] [--models ...] [--trace ...] [--gather ...]}
shift
[ "$NAME" != base ] || { echo "NAME base is this tree's label"; exit 2; }
ROOT=$PWD
OTHER=$ROOT/.build/ab/$NAME
patches=()
while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do patches+=("$(realpath "$1")"); shift; done
[ ${#patches[@]} -gt 0 ] || { echo "no patch given"; exit 2; }
rm -rf "$OTHER"
mkdir -p "$OTHER" "$ROOT/.build/kc"
git -C "$ROOT" archive HEAD mokgen benchmarks lab tests examples pyproject.toml | tar -x -C "$OTHER"
rm -rf "$OTHER/benchmarks/results"  # results stay in this tree; the copy travels with .build
for p in "${patches[@]}"; do  # patch, not git apply: .build is inside this repository
  patch -s -p1 -d "$OTHER" < "$p"
done
git -C "$ROOT" rev-parse --short HEAD > "$OTHER/BASE"
both() {  # both CMD...: CMD in this tree with its cache, then in the other with its own
  (cd "$ROOT" && PYTHONPATH=$ROOT MOKGEN_CACHE=$ROOT/.build/kc "$@")
  (cd "$OTHER" && PYTHONPATH=$OTHER MOKGEN_CACHE=$OTHER/kc "$@")
}
while [ $# -gt 0 ]; do
  case $1 in
    --models) both python3 benchmarks/prebuild.py layers "$2" --ep "$3" --tokens "$4"; shift 4 ;;
    --trace) both python3 lab/trace.py $2 --prebuild; shift 2 ;;
    --gather) both python3 lab/gather_ab.py --prebuild --shapes "$2" --variants "$3"; shift 3 ;;
    *) echo "unknown option $1"; exit 2 ;;
  esac
done
du -sh "$ROOT/.build"
