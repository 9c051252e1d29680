# next session, one call (root = main with `git am benchmarks/results/session24/pt192.patch`;
# carry nothing): the 128 x 192 whole-task ping-pong kernels checked bitwise against the
# cooperative tiles, then timed beside coop / pp / pt (128 x 128) / solo / torch on nine
# GEMMs (benchmarks/gemm_experiments.py --only pt builds .build/gemm_test.cubin if missing).
# Outputs: $OUT/gemm_experiments.json, $OUT/pt.log.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_backward.py -k experiments 2>&1 \
  | tail -n 5 | tee $OUT/pytest_experiments.log
timeout 400 python3 benchmarks/gemm_experiments.py --only pt --iters 20 2>&1 | tee $OUT/pt.log \
  | tail -n 16
