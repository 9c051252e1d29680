# Sourced by the multi-GPU device scripts: the environment all of their steps run in (the
# checkout on PYTHONPATH, a carried .mokgen-cache/ if there is one, NVLink multicast off).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -d .mokgen-cache ]; then export MOKGEN_CACHE=${MOKGEN_CACHE:-$PWD/.mokgen-cache}; fi
export MOKGEN_CACHE=${MOKGEN_CACHE:-/tmp/mokgen-cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
