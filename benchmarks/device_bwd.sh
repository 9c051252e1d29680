#!/usr/bin/env bash
# One device call for the backward work: GPU tests (backward first), then benchmarks.
# Usage: bash benchmarks/device_bwd.sh [pytest -k expression]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOKGEN_CACHE=${MOKGEN_CACHE:-/tmp/mokgen-cache}
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -m gpu -x tests/test_gpu_backward.py ${1:+-k "$1"} 2>&1 | tee "$OUT/pytest_bwd.log" | tail -30
