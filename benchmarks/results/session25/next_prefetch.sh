# next session, one call (~5 min; tree = main + `git apply results/session25/prefetch_epi.patch`; the
# tree before it exported to .build/ab/old: `git archive main | tar -x -C .build/ab/old`;
# kernels of both prebuilt here, carry .build):
#   MOKGEN_CACHE=$PWD/.build/kc python benchmarks/trace.py qwen3-30b-a3b 1 8192 --prebuild
#   MOKGEN_CACHE=$PWD/.build/kc python benchmarks/gather_ab.py --prebuild --variants pull \
#     --shapes qwen3-30b-a3b,olmoe-1b-7b,qwen3-235b-a22b,mixtral-8x7b
#   (and the same in .build/ab/old with MOKGEN_CACHE=$PWD/kc)
# The forward down tiles' epilogue prefetch (their table entries and router weights, asked
# into L2 by the producer once a tile's slices are issued; the backward's were dropped: its
# producer spilled 12-16 B with them): the GPU checks (a prefetch changes no value, so these
# say the kernels still run), the traced A/B (Down's epilogue SM-ms) and gather_ab "pull"
# ABBA by process on four shapes. Prediction: Down epilogue 12 -> ~8 SM-ms, forward -1..3%.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
ROOT=$PWD; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
for t in "test_gpu_forward.py" "test_gpu_backward.py -k keep_h"; do
  PYTHONPATH=$ROOT MOKGEN_CACHE=$ROOT/.build/kt timeout 150 python3 -m pytest -q -m gpu \
    -o faulthandler_timeout=140 tests/$t > $OUT/pytest_${t%%.py*}.log 2>&1
  el "$t: $(tail -n 1 $OUT/pytest_${t%%.py*}.log)"
done
SLICE_TIMEOUT=60 bash benchmarks/ab_trace.sh old "qwen3-30b-a3b 1 8192" > $OUT/ab_trace.log 2>&1
el "ab_trace done"; grep -E "^==|^\| (Dx|Down|Wgrad|Dgrad|GateUp|all)" $OUT/ab_trace.log
S=qwen3-30b-a3b,olmoe-1b-7b,qwen3-235b-a22b,mixtral-8x7b
i=0
for side in old new new old; do
  i=$((i + 1))
  if [ $side = new ]; then tree=$ROOT; kc=$ROOT/.build/kc; else tree=$ROOT/.build/ab/old; kc=$tree/kc; fi
  (cd $tree && PYTHONPATH=$tree MOKGEN_CACHE=$kc timeout 100 python3 benchmarks/gather_ab.py \
     --variants pull --shapes $S --out $OUT/ab_${i}_$side > $OUT/ab_${i}_$side.log 2>&1)
  el "ab $i $side"; grep "^| [a-z]" $OUT/ab_${i}_$side.log
done
