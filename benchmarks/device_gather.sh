#!/usr/bin/env bash
# One device call for gathered rows (limits.GATHER): the bitwise gather-vs-pull GPU test, the
# A/B benchmark on SonicMoE's shapes (kernels prebuilt into a carried .mokgen-cache:
# `python3 benchmarks/gather_ab.py --prebuild`), then the GPU suites the change reaches, each
# step under its own time limit so the call returns what it got.
source benchmarks/device_env.sh
export MOKGEN_COMMIT=${MOKGEN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout ${T_TEST:-200} python3 -m pytest -x -v -m gpu tests/test_gpu_backward.py -k gathered \
    2>&1 | tail -15 | tee "$OUT/pytest_gathered.log"
timeout ${T_AB:-200} python3 benchmarks/gather_ab.py --out "$OUT" ${AB_ARGS:-} 2>&1 \
    | tail -12 | tee "$OUT/gather_ab.log"
timeout ${T_SUITE:-150} python3 -m pytest -q -m gpu ${SUITE:-tests/test_gpu_backward.py \
    tests/test_gpu_forward.py tests/test_gpu_memory.py tests/test_gpu_module.py} 2>&1 \
    | tail -25 | tee "$OUT/pytest_suite.log"
