# session 27, call 7 (one H200; carry .build/kt2: these tests' kernels built here): the staged
# down rows (store_rows_staged) against the reference, forward and backward, every model
# preset reduced (D 2880 among them: edge tiles) and test_gpu_forward.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOKGEN_CACHE=$PWD/.build/kt2
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
timeout 200 python3 -m pytest -q -m gpu -o faulthandler_timeout=190 tests/test_gpu_forward.py \
  > $OUT/pytest_fwd.log 2>&1
el "test_gpu_forward: $(tail -n 1 $OUT/pytest_fwd.log)"; grep "^FAILED\|^E " $OUT/pytest_fwd.log | head -8
timeout 280 python3 -m pytest -q -m gpu -o faulthandler_timeout=270 \
  "tests/test_gpu_shapes.py::test_every_model_preset_reduced" > $OUT/pytest_shapes.log 2>&1
el "presets reduced: $(tail -n 1 $OUT/pytest_shapes.log)"; grep "^FAILED\|^E " $OUT/pytest_shapes.log | head -8
