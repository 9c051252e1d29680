# next session, call 2 of 2 (carry .build/kt alone, 47 MB: test_gpu_backward's collected
# plans built from the early_epi.patch tree at session 26's end), after next_early.sh:
# the backward GPU tests on the patched tree, then what time is left of the fp8 tests.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
ROOT=$PWD; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
PYTHONPATH=$ROOT MOKGEN_CACHE=$ROOT/.build/kt timeout 330 python3 -m pytest -q -m gpu \
  -o faulthandler_timeout=320 tests/test_gpu_backward.py > $OUT/pytest_bwd.log 2>&1
el "test_gpu_backward: $(tail -n 1 $OUT/pytest_bwd.log)"; grep "^FAILED" $OUT/pytest_bwd.log | head -5
PYTHONPATH=$ROOT timeout 220 python3 -m pytest -q -m gpu -o faulthandler_timeout=210 \
  tests/test_gpu_fp8.py > $OUT/pytest_fp8.log 2>&1
el "test_gpu_fp8: $(tail -n 1 $OUT/pytest_fp8.log)"; grep "^FAILED" $OUT/pytest_fp8.log | head -5
