# session 26, call 5: the GPU suite on the head (5219431's register split 56 / 224 and the
# descriptor prefetch at thread 0 had run only test_gpu_backward -k keep_h, the forward and
# memory tests): the whole backward file, the module and transformers files, then fp8.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
for spec in "test_gpu_backward.py 330" "test_gpu_module.py 80" "test_gpu_transformers.py 60" \
            "test_gpu_fp8.py 90"; do
  set -- $spec
  timeout $2 python3 -m pytest -q -m gpu -o faulthandler_timeout=$(( $2 - 5 )) tests/$1 \
    > $OUT/pytest_${1%%.py}.log 2>&1
  el "$1: $(tail -n 1 $OUT/pytest_${1%%.py}.log)"
  grep -E "^FAILED" $OUT/pytest_${1%%.py}.log | head -5
done
