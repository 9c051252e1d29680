# next session, one call (root = main with fuse-auto applied: `git am
# benchmarks/results/session24/fuse_auto.patch` or merge the branch; carry .kc25: the tests'
# 77 kernels, built in session 24, if the checkout kept it): the GPU tests of every
# mokgen.MoE / patched-model training path the fused-by-default accumulation reaches, and
# session 24's autograd.grad test. Outputs: $OUT/t.tgz (rewritten after every step).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
export MOKGEN_CACHE=$PWD/.kc25
W=/tmp/wT; mkdir -p $W; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $W/steps.log; tar -czf $OUT/t.tgz -C $W .; }
i=0
for t in "tests/test_gpu_memory.py" "tests/test_gpu_module.py" \
         "tests/test_gpu_transformers.py" "tests/test_gpu_backward.py -k keep_h"; do
  i=$((i + 1))
  timeout 140 python3 -m pytest -q -m gpu -o faulthandler_timeout=130 $t > $W/pytest_$i.log 2>&1
  el "$t: $(tail -n 1 $W/pytest_$i.log)"
done
grep -hE "FAILED|ERROR" $W/pytest_*.log | head -20
