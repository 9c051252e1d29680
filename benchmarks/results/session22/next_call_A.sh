# next session, call A (carry .build/dev, .kc3, .build/ab/kr): build the GPU tests' kernels on
# the device (.kc3/next.pkl), run the tests session 22 did not reach, then the kept-rows tree.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
R=$OUT; T0=$(date +%s); ROOT=$PWD
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/steps.log; }
export MOKGEN_CACHE=$ROOT/.kc4
timeout 150 python3 benchmarks/collect_kernels.py .kc3/next.pkl > $R/build.log 2>&1
el "built: $(tail -n 1 $R/build.log)"
# (one -k per pytest run: a second -k replaces the first)
timeout 120 python3 -m pytest -v -m gpu -o faulthandler_timeout=100 tests/test_gpu_shapes.py -k keep_h \
  > $R/pytest_A1.log 2>&1
el "A1 (x-pulling kernel at every preset): $(tail -n 1 $R/pytest_A1.log)"
timeout 150 python3 -m pytest -v -m gpu -o faulthandler_timeout=100 tests/test_gpu_forward.py \
  tests/test_gpu_prologue.py > $R/pytest_A2.log 2>&1
el "A2 (forward, prologue): $(tail -n 1 $R/pytest_A2.log)"
grep -hE "FAILED|ERROR" $R/pytest_A1.log $R/pytest_A2.log | head
(cd .build/ab/kr && PYTHONPATH=$PWD timeout 150 python3 -m pytest -v -m gpu -o faulthandler_timeout=100 \
  tests/test_gpu_backward.py -k keep_h tests/test_gpu_memory.py -k "keep_h or checkpoint" > $R/pytest_kr.log 2>&1)
el "kept-rows: $(tail -n 1 $R/pytest_kr.log)"
grep -E "FAILED|ERROR" $R/pytest_kr.log | head
