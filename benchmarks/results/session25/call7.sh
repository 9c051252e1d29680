# session 25, the last call (carry .build: this tree's kernels in .build/kc, the head before
# the Dx fence change exported to .build/ab/old with its own; .kcb: test_gpu_backward -k
# keep_h's kernels from this tree): the keep_h backward tests, the Qwen3-30B trace of both
# trees (ab_trace.sh), then gather_ab "pull" on Qwen3-30B and Qwen3-235B, ABBA by process.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
ROOT=$PWD; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
PYTHONPATH=$ROOT MOKGEN_CACHE=$ROOT/.kcb timeout 100 python3 -m pytest -q -m gpu \
  -o faulthandler_timeout=95 tests/test_gpu_backward.py -k keep_h > $OUT/pytest_bwd.log 2>&1
el "test_gpu_backward -k keep_h: $(tail -n 1 $OUT/pytest_bwd.log)"
SLICE_TIMEOUT=60 bash benchmarks/ab_trace.sh old "qwen3-30b-a3b 1 8192" > $OUT/ab_trace.log 2>&1
el "ab_trace done"; grep -E "^==|^\| (Dx|Down|Wgrad|Dgrad|GateUp|all)" $OUT/ab_trace.log
i=0
for side in old new new old; do
  i=$((i + 1))
  if [ $side = new ]; then tree=$ROOT; kc=$ROOT/.build/kc; else tree=$ROOT/.build/ab/old; kc=$tree/kc; fi
  (cd $tree && PYTHONPATH=$tree MOKGEN_CACHE=$kc timeout 60 python3 benchmarks/gather_ab.py \
     --variants pull --shapes qwen3-30b-a3b,qwen3-235b-a22b --out $OUT/ab_${i}_$side > $OUT/ab_${i}_$side.log 2>&1)
  el "ab $i $side"; grep "^| [a-z]" $OUT/ab_${i}_$side.log
done
