export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
bash benchmarks/results/session25/next_pt4.sh > $OUT/pt4.log 2>&1; el pt4; tail -n 20 $OUT/pt4.log
for t in test_gpu_memory.py test_gpu_backward.py; do
  timeout 150 python3 -m pytest -q -m gpu -o faulthandler_timeout=140 tests/$t > $OUT/pytest_${t%%.py}.log 2>&1
  el "$t: $(tail -n 1 $OUT/pytest_${t%%.py}.log)"
done
