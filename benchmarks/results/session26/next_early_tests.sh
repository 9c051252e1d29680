# next session, call 2 of 2 (carry .build/kt alone, 47 MB: test_gpu_backward's collected
# plans, built at session 26's end from the tree of both patches, early_epi.patch and
# tma_gateup.patch), after next_early.sh: the backward GPU tests on that tree, then what
# time is left of the fp8 tests. (A tree of one patch only finds no kernel here: JIT.)
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
ROOT=$PWD; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
PYTHONPATH=$ROOT MOKGEN_CACHE=$ROOT/.build/kt timeout 330 python3 -m pytest -q -m gpu \
  -o faulthandler_timeout=320 tests/test_gpu_backward.py > $OUT/pytest_bwd.log 2>&1
el "test_gpu_backward: $(tail -n 1 $OUT/pytest_bwd.log)"; grep "^FAILED" $OUT/pytest_bwd.log | head -5
PYTHONPATH=$ROOT timeout 220 python3 -m pytest -q -m gpu -o faulthandler_timeout=210 \
  tests/test_gpu_fp8.py > $OUT/pytest_fp8.log 2>&1
el "test_gpu_fp8: $(tail -n 1 $OUT/pytest_fp8.log)"; grep "^FAILED" $OUT/pytest_fp8.log | head -5
