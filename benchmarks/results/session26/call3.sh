# session 26, call 3: the forward's routed down rows through shared memory by bulk copies
# (gemm_epilogue.cuh store_rows_bulk) against the head before it (.build/ab/old = 5219431):
# the GPU forward tests (bitwise/reference checks of the new epilogue), the traced A/B on
# Qwen3-30B (Down epilogue SM-ms) and gather_ab "pull" ABBA on four shapes.
# (32-column copies: the first version, not kept; bulk_down.patch holds the whole-row one.)
# Prediction: Down epilogue 11.6 -> ~3 SM-ms; forward +3..8% on the short-K shapes.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
ROOT=$PWD; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
PYTHONPATH=$ROOT timeout 200 python3 -m pytest -q -m gpu -o faulthandler_timeout=190 \
  tests/test_gpu_forward.py > $OUT/pytest_fwd.log 2>&1
el "test_gpu_forward: $(tail -n 1 $OUT/pytest_fwd.log)"
SLICE_TIMEOUT=60 bash benchmarks/ab_trace.sh old "qwen3-30b-a3b 1 8192" > $OUT/ab_trace.log 2>&1
el "ab_trace done"; grep -E "^==|^\| (Down|GateUp|all)" $OUT/ab_trace.log | head -8
# (ran as the ABBA loop that benchmarks/ab_gather.sh now holds: old, new, new, old)
bash benchmarks/ab_gather.sh old qwen3-30b-a3b,olmoe-1b-7b,qwen3-235b-a22b,mixtral-8x7b
