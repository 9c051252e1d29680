# next session, one call (carry nothing; ~3 min): the whole-task ping-pong at the megakernels'
# ring depth (pt4: 128 x 128 tasks, 4 stages, against pt's 6) checked bitwise against the
# cooperative tiles with every other experiment kernel, then timed on ten GEMMs, the new one
# Qwen3-30B's down rows (8192 x 2048 x 768, K-major: the forward's down tiles, 0.1 ms a layer
# behind SonicMoE's down GEMM). Reading: pt4/pt ~1 on the short-K rows says ring depth did not
# hold session 8's solo tiles to half rate; pt/coop on the down row says what a solo (whole-task)
# down tile could gain. Outputs: $OUT/gemm_experiments.json, $OUT/pt.log.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_backward.py -k experiments 2>&1 \
  | tail -n 5 | tee $OUT/pytest_experiments.log
timeout 400 python3 benchmarks/gemm_experiments.py --only pt --iters 20 2>&1 | tee $OUT/pt.log \
  | tail -n 17
