# next session, call 1 of 2 (~5 min; carry .build/kc and .build/ab, 36 MB): the epilogues'
# table entries and router weights loaded when the consumers take a task (early_epi.patch:
# gemm_tile.cuh EpiArgsTrait, moe_fwd.cuh RowRoutes; the forward's routed down tiles, the
# backward's dgrad and dx tiles, bf16 kernels), against the head before it (.build/ab/old:
# 5219431's code), and the forward GPU tests on the patched tree.
# First, here: `git apply benchmarks/results/session26/early_epi.patch` (.build/kc, the
# trace and gather_ab kernels, was built from the patched tree at session 26's end;
# .build/ab/old/kc from the head's). Call 2, if this one bears the hypothesis out:
# next_early_tests.sh (carry .build/kt alone: 47 MB, the 64 MB limit takes no more).
# Hypothesis (session 26): a down tile's epilogue takes 2.5-2.7 us whether its rows leave by
# register stores or by async bulk copies, so not the stores: its first instructions wait
# for the table / weight loads, issued after the mainloop, behind the next tile's operands
# (the producer refills the whole ring, 192 KB, as the mainloop ends). Prediction: Down
# epilogue 11.6 -> <= 5 SM-ms, Dx 11.4 -> <= 5, Dgrad 20 -> ~18 (its g / u loads stay in
# the epilogue: issue-bound, NOTES 2026-12-01); forward +2..5%, backward +1..3%. The
# hypothesis is refuted if Down's and Dx's epilogue SM-ms stay within 10%.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
ROOT=$PWD; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
PYTHONPATH=$ROOT timeout 150 python3 -m pytest -q -m gpu -o faulthandler_timeout=140 \
  tests/test_gpu_forward.py > $OUT/pytest_fwd.log 2>&1
el "test_gpu_forward: $(tail -n 1 $OUT/pytest_fwd.log)"; grep "^FAILED" $OUT/pytest_fwd.log | head -5
SLICE_TIMEOUT=60 bash benchmarks/ab_trace.sh old "qwen3-30b-a3b 1 8192" > $OUT/ab_trace.log 2>&1
el "ab_trace"; grep -E "^==|^\| (Down|GateUp|Dx|Dgrad|Wgrad)" $OUT/ab_trace.log
bash benchmarks/ab_gather.sh old qwen3-30b-a3b,olmoe-1b-7b,qwen3-235b-a22b,mixtral-8x7b
el "ab_gather"
