# session 23, call 1 (root = branch next23: kept-rows + xpull-join + ctypes-launch on main;
# carry .kc7): build the tests' kernels, then the x-pulling (joining) kernel at every preset,
# the keep_h backward / memory tests (kept rows), forward + prologue under MOKGEN_LAUNCH=ctypes.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
R=$OUT; T0=$(date +%s); ROOT=$PWD
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/steps.log; }
export MOKGEN_CACHE=$ROOT/.kc
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv > $R/smi.txt 2>&1
timeout 140 python3 benchmarks/collect_kernels.py .kc7/next23.pkl > $R/build.log 2>&1
el "built: $(tail -n 1 $R/build.log)"
timeout 120 python3 -m pytest -v -m gpu -o faulthandler_timeout=100 tests/test_gpu_shapes.py -k keep_h \
  > $R/pytest_1_shapes.log 2>&1
el "1 shapes keep_h (joining x-pulling kernel, every preset): $(tail -n 1 $R/pytest_1_shapes.log)"
timeout 160 python3 -m pytest -v -m gpu -o faulthandler_timeout=120 tests/test_gpu_backward.py tests/test_gpu_memory.py \
  -k "keep_h or checkpoint or memory or steady" > $R/pytest_2_bwd.log 2>&1
el "2 backward/memory keep_h (kept rows, joining): $(tail -n 1 $R/pytest_2_bwd.log)"
MOKGEN_LAUNCH=ctypes timeout 150 python3 -m pytest -v -m gpu -o faulthandler_timeout=120 tests/test_gpu_forward.py \
  tests/test_gpu_prologue.py > $R/pytest_3_fwd_ctypes.log 2>&1
el "3 forward+prologue (ctypes launches): $(tail -n 1 $R/pytest_3_fwd_ctypes.log)"
grep -hE "FAILED|ERROR" $R/pytest_*.log | head -20
