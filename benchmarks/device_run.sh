#!/usr/bin/env bash
# One device call: GPU tests, then the layer benchmark. Usage: bash benchmarks/device_run.sh [bench args]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOKGEN_CACHE=${MOKGEN_CACHE:-/tmp/mokgen-cache}
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
python3 -m pytest -q -m gpu -x tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 benchmarks/moe_layer.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -30
fi
