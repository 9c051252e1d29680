# session 27, call 9 (one H200; carry .build/kt3: these tests' kernels built here): the staged gate/up and
# down rows (store_gate_up_staged, store_rows_staged) against the reference, forward and backward, four model presets
# reduced with edge widths (D 2880, I 1408, shared 5632 / 2816) and test_gpu_forward.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOKGEN_CACHE=$PWD/.build/kt3
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
timeout 200 python3 -m pytest -q -m gpu -o faulthandler_timeout=190 tests/test_gpu_forward.py \
  > $OUT/pytest_fwd.log 2>&1
el "test_gpu_forward: $(tail -n 1 $OUT/pytest_fwd.log)"; grep "^FAILED\|^E " $OUT/pytest_fwd.log | head -8
timeout 280 python3 -m pytest -q -m gpu -o faulthandler_timeout=270 \
  "tests/test_gpu_shapes.py::test_every_model_preset_reduced[gpt-oss-20b]" "tests/test_gpu_shapes.py::test_every_model_preset_reduced[deepseek-v2-lite]" "tests/test_gpu_shapes.py::test_every_model_preset_reduced[qwen1.5-moe-a2.7b]" "tests/test_gpu_shapes.py::test_every_model_preset_reduced[granite-3.0-3b-a800m]" > $OUT/pytest_shapes.log 2>&1
el "presets reduced: $(tail -n 1 $OUT/pytest_shapes.log)"; grep "^FAILED\|^E " $OUT/pytest_shapes.log | head -8
