# session 28 call 13 (carry .build/gt28: gemm_test.cu built here at cb8eaf8): B multicast over
# a 2-CTA cluster (mc) against the same pairs loading all of B (pair) and the atomic
# cooperative engine (coop), each also back to back for 1 s under the power cap (mirrored)
timeout 170 python3 -u benchmarks/gemm_experiments.py --cubin .build/gt28/gemm_test.cubin \
  --only pairs --rounds 1 --iters 20 --sustained 1.0 2>&1 | grep --line-buffered -v "^\[check\]" \
  | tee $OUT/gemm_experiments.log
