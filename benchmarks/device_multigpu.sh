#!/usr/bin/env bash
# One device call on a multi-GPU machine (nvidia-h200-x2/x4/x8): the multigpu tests at every
# world size the machine allows, then the EP benchmark at each. NVLink multicast stays off.
# Usage: bash benchmarks/device_multigpu.sh [tokens, default 1024,2048,4096]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOKGEN_CACHE=${MOKGEN_CACHE:-/tmp/mokgen-cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
GPUS=$(nvidia-smi -L | wc -l)
nvidia-smi topo -m | head -12
for R in 2 4 8; do
  [ "$R" -le "$GPUS" ] || continue
  echo "== tests, world size $R"
  timeout 300 torchrun --nproc-per-node=$R -m pytest -q -m multigpu tests/test_multigpu.py \
    2>&1 | tee "$OUT/pytest_multigpu_$R.log" | tail -5
done
for R in 2 4 8; do
  [ "$R" -le "$GPUS" ] || continue
  echo "== benchmark, ep $R"
  timeout 400 torchrun --nproc-per-node=$R benchmarks/multigpu.py --tokens "${1:-1024,2048,4096}" \
    --out "$OUT" 2>&1 | grep -v '^{' | tail -14
done
