#!/usr/bin/env bash
# One device call for the schedule's prologue kernels: their GPU test (bitwise against
# mokgen.schedule), the prologue benchmark (table + JSON under $OUT), then the forward and
# backward layers' GPU tests that run the schedule inside a whole layer (odd token counts,
# skewed routing, ring replay), then the Qwen3-30B-A3B training step's profile (ep 1, 8192
# tokens: where mokgen_sched_count took 176 us at 22c0a7d). Builds go to a carried
# .mokgen-cache/ when there is one. Two device calls (10 minutes each at most):
#   MOKGEN_COMMIT=<sha> STEPS="test bench" bash benchmarks/device_prologue.sh
#   STEPS="layers step" bash benchmarks/device_prologue.sh
source benchmarks/device_env.sh
STEPS=${STEPS:-test bench}
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
for step in $STEPS; do
  case $step in
    test) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu tests/test_gpu_prologue.py \
            > "$OUT/pytest_prologue.log" 2>&1
          echo "== pytest prologue: $(tail -1 "$OUT/pytest_prologue.log")"
          grep -h "^FAILED\|^E  " "$OUT/pytest_prologue.log" | head -20 ;;
    bench) timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/prologue.py --out "$OUT" 2>&1 |
            tee "$OUT/prologue.log" | tail -12 ;;
    layers) timeout ${LAYER_TIMEOUT:-300} python3 -m pytest -q -m gpu -x \
              tests/test_gpu_forward.py tests/test_gpu_backward.py \
              -k "odd_token_counts or skewed or virtual_ranks or ring_replay" \
              > "$OUT/pytest_layers.log" 2>&1
            echo "== pytest layers: $(tail -1 "$OUT/pytest_layers.log")"
            grep -h "^FAILED\|^ERROR" "$OUT/pytest_layers.log" | head -20 ;;
    step) timeout ${STEP_TIMEOUT:-240} python3 benchmarks/profile_step.py --shape qwen3-30b-a3b \
            --tokens 8192 > "$OUT/profile_step.log" 2>&1
          grep -h "mokgen_\|step_tflops" "$OUT/profile_step.log" | cut -c1-160 ;;
  esac
done
