# session 26, call 4: the forward's routed down rows staged whole (3 stages, 66 KB of rows)
# and copied out by 128 bulk copies a tile (store_rows_bulk) against the default forward
# (4 stages, register stores), same tree: the new GPU test (bitwise equal to the register
# stores), the traced pair on Qwen3-30B (Down epilogue SM-ms, GateUp mainloop at 3 stages)
# and gather_ab ABBA (pull vs pull+gemm_fwd=128:256:3) twice on four shapes.
# Prediction: Down epilogue 12 -> ~3 SM-ms; GateUp mainloop within 2% at 3 stages; forward
# +3..8% on Qwen3 / OLMoE.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
timeout 200 python3 -m pytest -q -m gpu -o faulthandler_timeout=190 tests/test_gpu_forward.py \
  -k "bulk or virtual_ranks" > $OUT/pytest_fwd.log 2>&1
el "test_gpu_forward: $(tail -n 1 $OUT/pytest_fwd.log)"; grep -E "^(FAILED|E )" $OUT/pytest_fwd.log | head -5
for g in 128x256x4 128x256x3; do
  MOKGEN_CACHE=$PWD/.build/kc timeout 60 python3 benchmarks/trace.py qwen3-30b-a3b 1 8192 \
    --gemm $g --out $OUT/t$g > $OUT/trace_$g.log 2>&1
  el "trace $g: $(grep -h 'ms (event' $OUT/trace_$g.log)"; grep -E "^\| (Down|GateUp)" $OUT/trace_$g.log | head -2
done
for i in 1 2; do
  MOKGEN_CACHE=$PWD/.build/kc timeout 120 python3 benchmarks/gather_ab.py --variants \
    pull,pull+gemm_fwd=128:256:3 --shapes qwen3-30b-a3b,olmoe-1b-7b,qwen3-235b-a22b,mixtral-8x7b \
    --out $OUT/ab$i > $OUT/ab$i.log 2>&1
  el "ab $i"; grep "^| [a-z]" $OUT/ab$i.log
done
