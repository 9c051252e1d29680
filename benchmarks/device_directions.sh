#!/usr/bin/env bash
# The communication-direction ablation in one device call (nvidia-h200-x2; on one GPU the
# real-rank steps are skipped):
#   1. compile ahead (benchmarks/directions.py --prebuild --tests: nvcc in parallel, the
#      ablation's and the direction tests' kernels; a carried .mokgen-cache/ makes it a no-op)
#   2. GPU tests: every direction vs the reference and bitwise vs pull/push, virtual ranks
#      side by side (tests/test_gpu_directions.py)
#   3. the ablation on virtual ranks (one GPU, R = 2 megakernels side by side, 66 SMs each)
#   4. multi-GPU tests of the directions (torchrun, real ranks over NVLink)
#   5. the ablation on real ranks (torchrun --nproc-per-node=2)
# JSON and logs go to $OUT (directions_virtual_R2.json, directions_real_R2.json).
# Usage: MOKGEN_COMMIT=<sha> bash benchmarks/device_directions.sh [shape, default kimi-k2.7]
#        [load, default ep8] [tokens, default 2048]
# Expected: prebuild ~1-2 min on 32 cores (0 with a carried cache), tests ~1 min, each
# ablation ~1 min. Each step has a timeout.
source "$(dirname "$0")/device_env.sh"
SHAPE=${1:-kimi-k2.7}
LOAD=${2:-ep8}
TOKENS=${3:-2048}
GPUS=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
ARGS=(--shape "$SHAPE" --load "$LOAD" --tokens "$TOKENS" --out "$OUT")
echo "== prebuild ($MOKGEN_CACHE)"
timeout 240 python3 benchmarks/directions.py --prebuild --tests "${ARGS[@]}" 2>&1 | tail -2
if [ "$GPUS" -ge 2 ]; then
  timeout 240 python3 benchmarks/directions.py --prebuild --tests --world 2 "${ARGS[@]}" \
    2>&1 | tail -2
fi
echo "== GPU tests, virtual ranks"
timeout 300 python3 -m pytest -q tests/test_gpu_directions.py 2>&1 \
  | tee "$OUT/pytest_gpu_directions.log" | grep -E "passed|failed|error|Error" | tail -8
echo "== ablation, virtual ranks (one GPU)"
timeout 300 python3 benchmarks/directions.py "${ARGS[@]}" 2>&1 \
  | tee "$OUT/directions_virtual.log" | tail -10
if [ "$GPUS" -ge 2 ]; then
  echo "== multi-GPU tests of the directions, world size 2"
  timeout 300 torchrun --nproc-per-node=2 -m pytest -q -m multigpu tests/test_multigpu.py \
    -k direction 2>&1 | tee "$OUT/pytest_multigpu_directions.log" \
    | grep -E "passed|failed|error|Error" | tail -8
  echo "== ablation, real ranks (2 GPUs)"
  timeout 300 torchrun --nproc-per-node=2 benchmarks/directions.py "${ARGS[@]}" 2>&1 \
    | tee "$OUT/directions_real.log" | tail -10
fi
mkdir -p benchmarks/results
cp "$OUT"/directions_*_R*.json benchmarks/results/ 2>/dev/null
ls "$OUT"/directions_*_R*.json 2>/dev/null
