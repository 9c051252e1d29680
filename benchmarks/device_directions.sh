#!/usr/bin/env bash
# The communication-direction ablation, forward and backward (nvidia-h200-x2; on one GPU the
# real-rank steps are skipped). Steps, all by default, or a subset in $STEPS (each device call
# has 10 minutes: run it as two calls, see below):
#   prebuild   compile ahead (benchmarks/directions.py --prebuild --tests: nvcc in parallel,
#              the ablation's and the direction tests' kernels, virtual and world 2) into
#              .mokgen-cache/ (kept between calls on a warm machine; carried, it is a no-op)
#   gpu-tests  every direction, forward and backward, vs the reference and bitwise vs the
#              paper's, virtual ranks side by side (tests/test_gpu_directions.py)
#   virtual    the ablation on virtual ranks (one GPU, R = 2 megakernels side by side)
#   multigpu   multi-GPU tests of the directions (torchrun, real ranks over NVLink)
#   real       the ablation on real ranks (torchrun --nproc-per-node=2)
# JSON and logs go to $OUT (directions_{virtual,real}_R2.json: rows = the forward's four,
# backward_rows = the backward's four, each with its verdict).
# Usage: MOKGEN_COMMIT=<sha> [STEPS="prebuild gpu-tests"] bash benchmarks/device_directions.sh
#        [shape, default kimi-k2.7] [load, default ep8] [tokens, default 2048]
# Two calls: STEPS="prebuild gpu-tests" (~2 + ~3 min), then STEPS="virtual multigpu real"
# (~2 + ~1 + ~2 min). Each step has a timeout.
mkdir -p .mokgen-cache  # device_env.sh then builds into it
source "$(dirname "$0")/device_env.sh"
SHAPE=${1:-kimi-k2.7}
LOAD=${2:-ep8}
TOKENS=${3:-2048}
STEPS=${STEPS:-prebuild gpu-tests virtual multigpu real}
GPUS=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
ARGS=(--shape "$SHAPE" --load "$LOAD" --tokens "$TOKENS" --out "$OUT")
step() { [[ " $STEPS " == *" $1 "* ]]; }
if step prebuild; then
  echo "== prebuild ($MOKGEN_CACHE)"
  timeout 300 python3 benchmarks/directions.py --prebuild --tests "${ARGS[@]}" 2>&1 | tail -2
  if [ "$GPUS" -ge 2 ] && { step multigpu || step real; }; then  # world-2 kernels
    timeout 240 python3 benchmarks/directions.py --prebuild --tests --world 2 "${ARGS[@]}" \
      2>&1 | tail -2
  fi
fi
if step gpu-tests; then
  echo "== GPU tests, virtual ranks"
  timeout 420 python3 -m pytest -q -rf tests/test_gpu_directions.py 2>&1 \
    | tee "$OUT/pytest_gpu_directions.log" | grep -E "passed|failed|FAILED|error|Error" | tail -12
fi
if step virtual; then
  echo "== ablation, virtual ranks (one GPU)"
  timeout 300 python3 benchmarks/directions.py "${ARGS[@]}" 2>&1 \
    | tee "$OUT/directions_virtual.log" | tail -16
fi
if [ "$GPUS" -ge 2 ] && step multigpu; then
  echo "== multi-GPU tests of the directions, world size 2"
  timeout 240 torchrun --nproc-per-node=2 -m pytest -q -rf -m multigpu tests/test_multigpu.py \
    -k direction 2>&1 | tee "$OUT/pytest_multigpu_directions.log" \
    | grep -E "passed|failed|FAILED|error|Error" | tail -12
fi
if [ "$GPUS" -ge 2 ] && step real; then
  echo "== ablation, real ranks (2 GPUs)"
  timeout 300 torchrun --nproc-per-node=2 benchmarks/directions.py "${ARGS[@]}" 2>&1 \
    | tee "$OUT/directions_real.log" | tail -16
fi
mkdir -p benchmarks/results
cp "$OUT"/directions_*_R*.json benchmarks/results/ 2>/dev/null
ls "$OUT"/directions_*_R*.json 2>/dev/null
