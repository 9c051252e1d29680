#!/usr/bin/env bash
# One device call for the GEMM engine's ping-pong consumer schedule (#17 item 1): its GPU tests
# (the layer forward + backward vs the reference, bitwise repeats, bitwise equal to the
# cooperative schedule; the engine alone), the engine alone in both schedules, then the layer
# benchmark in both schedules. Kernels compile here unless a carried .mokgen-cache has them.
# Usage: bash benchmarks/device_pingpong.sh [quick]   (quick: checks and the K = 384 rows only)
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -x tests/test_gpu_pingpong.py 2>&1 \
  | tee "$OUT/pytest_pingpong.log" | tail -20
timeout 240 python3 benchmarks/gemm_engine.py --cubin /tmp/gemm_test.cubin \
  ${1:+--quick} 2>&1 | tee "$OUT/gemm_engine.log" | tail -30
[ "${1:-}" = quick ] && exit 0
timeout 400 python3 -m mokgen bench --backward --pingpong --shapes kimi-k2.7,qwen3.5-397b-a17b \
  --ep 8,64 --tokens 2048 --iters 20 --out "$OUT" 2>&1 | tee "$OUT/bench_pingpong.log" | tail -20
