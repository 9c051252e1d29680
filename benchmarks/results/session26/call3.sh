# session 26, call 3: the forward's routed down rows through shared memory by bulk copies
# (gemm_epilogue.cuh store_rows_bulk) against the head before it (.build/ab/old = 5219431):
# the GPU forward tests (bitwise/reference checks of the new epilogue), the traced A/B on
# Qwen3-30B (Down epilogue SM-ms) and gather_ab "pull" ABBA on four shapes.
# Prediction: Down epilogue 11.6 -> ~3 SM-ms; forward +3..8% on the short-K shapes.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
ROOT=$PWD; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
PYTHONPATH=$ROOT timeout 200 python3 -m pytest -q -m gpu -o faulthandler_timeout=190 \
  tests/test_gpu_forward.py > $OUT/pytest_fwd.log 2>&1
el "test_gpu_forward: $(tail -n 1 $OUT/pytest_fwd.log)"
SLICE_TIMEOUT=60 bash benchmarks/ab_trace.sh old "qwen3-30b-a3b 1 8192" > $OUT/ab_trace.log 2>&1
el "ab_trace done"; grep -E "^==|^\| (Down|GateUp|all)" $OUT/ab_trace.log | head -8
S=qwen3-30b-a3b,olmoe-1b-7b,qwen3-235b-a22b,mixtral-8x7b
i=0
for side in old new new old; do
  i=$((i + 1))
  if [ $side = new ]; then tree=$ROOT; kc=$ROOT/.build/kc; else tree=$ROOT/.build/ab/old; kc=$tree/kc; fi
  (cd $tree && PYTHONPATH=$tree MOKGEN_CACHE=$kc timeout 100 python3 benchmarks/gather_ab.py \
     --variants pull --shapes $S --out $OUT/ab_${i}_$side > $OUT/ab_${i}_$side.log 2>&1)
  el "ab $i $side"; grep "^| [a-z]" $OUT/ab_${i}_$side.log
done
