# next session, call 1 of 2 (~6 min; carry .build/kc and .build/ab: 52 MB with the tree).
# Two prepared changes (session 26, NOT GPU-run), measured against the trees before them:
# - early_epi.patch: a routed down tile's table entries and router weights loaded when the
#   consumers take the task (gemm_tile.cuh EpiArgsTrait, moe_fwd.cuh RowRoutes; forward,
#   bf16). Its tree with its kernels: .build/ab/early. Hypothesis: a down tile's epilogue
#   (2.5-2.7 us whether its rows leave by register stores or async bulk copies) waits on
#   those loads, which after the mainloop queue behind the next tile's operands (the
#   producer refills the ring, 192 KB, then). Prediction: Down epilogue 11.6 -> <= 5 SM-ms,
#   Dx (the backward's like tile, unchanged: the control) within noise; forward +2..5%.
#   Refuted if Down's epilogue SM-ms stay within 10%.
# - tma_gateup.patch (on top): the routed gate/up tiles' act, g and u through shared memory
#   and TMA stores (gemm_epilogue.cuh store_gate_up_tma; 32 KB of staging beside the 4
#   stages: two 8 KB boxes a warpgroup), instead of 16-byte register stores after quad
#   transposes (~490 of the epilogue's ~1,100 instructions a thread). Prediction: GateUp
#   epilogue 14 -> <= 8 SM-ms (4.0 -> <= 2.3 us a tile), its signal (the stores' drain,
#   now the issuer's bulk wait) about the same; forward +3..6% on Qwen3-30B / OLMoE.
# First, here: `git apply benchmarks/results/session26/early_epi.patch` then
# `git apply benchmarks/results/session26/tma_gateup.patch` (.build/kc was built from that
# tree, .build/ab/early/kc from the early tree, .build/ab/old/kc from 5219431's code).
# Reading: ab_trace's "early" run gives base (both) against early (the TMA stores alone),
# its "old" run base against old (both); early's own table against old's is the early loads.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
ROOT=$PWD; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
PYTHONPATH=$ROOT timeout 150 python3 -m pytest -q -m gpu -o faulthandler_timeout=140 \
  tests/test_gpu_forward.py > $OUT/pytest_fwd.log 2>&1
el "test_gpu_forward: $(tail -n 1 $OUT/pytest_fwd.log)"; grep "^FAILED" $OUT/pytest_fwd.log | head -5
for other in early old; do
  SLICE_TIMEOUT=60 bash benchmarks/ab_trace.sh $other "qwen3-30b-a3b 1 8192" \
    > $OUT/ab_trace_$other.log 2>&1
  el "ab_trace $other"
  grep -E "^==|^\| (Down|GateUp|Dx|Dgrad)" $OUT/ab_trace_$other.log | cut -c1-110
done
for other in early old; do
  mkdir -p $OUT/g_$other
  OUT=$OUT/g_$other bash benchmarks/ab_gather.sh $other \
    qwen3-30b-a3b,olmoe-1b-7b,qwen3-235b-a22b,mixtral-8x7b > $OUT/ab_gather_$other.log 2>&1
  el "ab_gather $other"; cat $OUT/ab_gather_$other.log
done
