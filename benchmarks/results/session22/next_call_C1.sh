# next session, call C1 (carry .build/dev, .build/ab): branch xpull-join's GPU tests (the
# x-pulling backward's comm CTAs join the compute after their pulls): keep_h stacks,
# checkpointing, and the x-pulling kernel at every preset's widths.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
R=$OUT; T0=$(date +%s); ROOT=$PWD
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/steps.log; }
export MOKGEN_CACHE=$ROOT/.kc6
(cd .build/ab/xj && PYTHONPATH=$PWD timeout 250 python3 -m pytest -v -m gpu -o faulthandler_timeout=100 \
  tests/test_gpu_backward.py tests/test_gpu_memory.py -k "keep_h or checkpoint" > $R/pytest_xj.log 2>&1)
el "xj keep_h tests: $(tail -n 1 $R/pytest_xj.log)"
(cd .build/ab/xj && PYTHONPATH=$PWD timeout 250 python3 -m pytest -v -m gpu -o faulthandler_timeout=100 \
  tests/test_gpu_shapes.py -k keep_h > $R/pytest_xj_shapes.log 2>&1)
el "xj presets: $(tail -n 1 $R/pytest_xj_shapes.log)"
grep -hE "FAILED|ERROR" $R/pytest_xj*.log | head
