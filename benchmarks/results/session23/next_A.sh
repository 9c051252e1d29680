# next session, call A (root = main at the head; carry .kc8 if collected there: the plan list
# of these tests, `python -m pytest -q -p benchmarks.collect_kernels -m gpu FILES
# --collect-out .kc8/a.pkl`): the GPU tests session 23 did not reach. Outputs: $OUT/a.tgz
# (at most 8 files come back; the archive is rewritten after every step, so a call killed
# at its limit still returns it).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
W=/tmp/wA; mkdir -p $W; T0=$(date +%s); export MOKGEN_CACHE=$PWD/.kc
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $W/steps.log; tar -czf $OUT/a.tgz -C $W .; }
[ -f .kc8/a.pkl ] && timeout 120 python3 benchmarks/collect_kernels.py .kc8/a.pkl > $W/build.log 2>&1
el "built: $(tail -n 1 $W/build.log 2>/dev/null)"
i=0
for t in "tests/test_gpu_widths.py -k fp8" "tests/test_gpu_fp8.py" "tests/test_gpu_trace.py" \
         "tests/test_gpu_transformers.py" "tests/test_gpu_forward.py"; do
  i=$((i + 1))
  timeout 100 python3 -m pytest -q -m gpu -o faulthandler_timeout=90 $t > $W/pytest_$i.log 2>&1
  el "$t: $(tail -n 1 $W/pytest_$i.log)"
done
# (`mokgen tune --ep 1` is left out: its 12 candidates build 12 forward kernels, minutes of
# nvcc; prebuild them with collect_kernels' --bench or give it a call of its own)
grep -hE "FAILED|ERROR" $W/pytest_*.log | head -20
