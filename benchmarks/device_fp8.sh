#!/usr/bin/env bash
# One device call for the fp8 work (#5): GPU tests (fp8 first, then the bf16 forward's as a
# regression check), then the fp8 benchmark. Usage: bash benchmarks/device_fp8.sh [pytest -k]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOKGEN_CACHE=${MOKGEN_CACHE:-/tmp/mokgen-cache}
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -x tests/test_gpu_fp8.py ${1:+-k "$1"} \
  2>&1 | tee "$OUT/pytest_fp8.log" | tail -25
if [ -n "${EXTRA_TESTS:-}" ]; then  # regression: the bf16 kernels share the engine
  timeout ${EXTRA_TIMEOUT:-300} python3 -m pytest -q -m gpu $EXTRA_TESTS 2>&1 | tee "$OUT/pytest_extra.log" | tail -8
fi
if [ -n "${BENCH:-}" ]; then
  timeout ${BENCH_TIMEOUT:-250} python3 benchmarks/fp8.py $BENCH 2>&1 | tee "$OUT/bench_fp8.log" | tail -14
fi
if [ -n "${PROFILE:-}" ]; then
  timeout ${PROFILE_TIMEOUT:-200} python3 benchmarks/profile_fp8.py $PROFILE 2>&1 | grep '^{' | tee "$OUT/profile_fp8.log"
fi
