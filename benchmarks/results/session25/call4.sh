# session 25, call 4 (carry .build: this tree's kernels in .build/kc, the tree before the
# dn_done change exported to .build/ab/old with its kernels in .build/ab/old/kc):
# test_gpu_module (fused accumulation by default under torch.compile), then the forward
# A/B: gather_ab.py's default-plan layer ("pull") in both trees, ABBA by process, then the
# Qwen3-30B forward and backward traced in both (ab_trace.sh).
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
ROOT=$PWD; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
PYTHONPATH=$ROOT MOKGEN_CACHE=$ROOT/.build/kc timeout 150 python3 -m pytest -q -m gpu \
  -o faulthandler_timeout=140 tests/test_gpu_module.py > $OUT/pytest_module.log 2>&1
el "test_gpu_module: $(tail -n 1 $OUT/pytest_module.log)"
S=qwen3-30b-a3b,olmoe-1b-7b,qwen3-235b-a22b,mixtral-8x7b
i=0
for side in old new new old; do
  i=$((i + 1))
  if [ $side = new ]; then tree=$ROOT; kc=$ROOT/.build/kc; else tree=$ROOT/.build/ab/old; kc=$tree/kc; fi
  (cd $tree && PYTHONPATH=$tree MOKGEN_CACHE=$kc timeout 200 python3 benchmarks/gather_ab.py \
     --variants pull --shapes $S --out $OUT/ab_${i}_$side > $OUT/ab_${i}_$side.log 2>&1)
  el "ab $i $side done"
  grep "^| [a-z]" $OUT/ab_${i}_$side.log
done
SLICE_TIMEOUT=120 bash benchmarks/ab_trace.sh old "qwen3-30b-a3b 1 8192" > $OUT/ab_trace.log 2>&1
el "ab_trace done"
tail -n 30 $OUT/ab_trace.log
cd $OUT && tar -czf all.tgz --exclude=all.tgz . && ls
