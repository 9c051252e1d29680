#!/usr/bin/env bash
# One device call on a 2-GPU machine (nvidia-h200-x2) for issue #19's faults at R = 2:
#   1. compile ahead the tests' kernels (a carried .mokgen-cache/ whose keys match: no-op)
#   2. torchrun: NaN tokens on one rank stay in their own rows; 10,000 forward + backward
#      calls with flat memory (TEST_STEPS to change the count)
#   3. plain pytest (it starts both ranks itself): rank 1 SIGKILLed mid-training, rank 0
#      raises the watchdog's RuntimeError within watchdog_s + 1 s, twice, and exits
# Logs go to $OUT. NVLink multicast stays off. Expected: ~0.5 min for 1 with a carried cache,
# 2 under 2 min, 3 about 1.5 min (two cases, each: start, 5 steps, two 2 s watchdogs).
# Usage: bash benchmarks/device_faults.sh
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
echo "== prebuild (tests' kernels)"
timeout 150 python3 benchmarks/prebuild.py --world 2 --skip-bench 2>&1 | tail -2
echo "== NaN tokens, 10,000 training calls (torchrun, R = 2)"
MOKGEN_TEST_STEPS=${TEST_STEPS:-10000} timeout 300 torchrun --nproc-per-node=2 -m pytest -q \
  -s -m multigpu tests/test_multigpu.py -k "nan_tokens or ten_thousand" 2>&1 \
  | tee "$OUT/pytest_faults_torchrun.log" | grep -E "resident|passed|failed|Error" | tail -8
echo "== a rank killed mid-training (plain pytest, two ranks of its own)"
timeout 400 python3 -m pytest -q -s -m multigpu tests/test_multigpu_faults.py 2>&1 \
  | tee "$OUT/pytest_faults_kill.log" | grep -E "FAULT|\"calls\"|passed|failed|Error" | tail -8
