# session 27, call 3 (nvidia-h200-x2): the multigpu tests with the memory test's fix, and the
# FSDP-style gather beside the layer at reserves 0/4/8/16 with each overlapped call's kernels.
source benchmarks/device_env.sh
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
timeout 120 python3 benchmarks/prebuild.py --world 2 --skip-bench 2>&1 | tail -1
python3 - <<'PY'
import sys; sys.path.insert(0, "benchmarks")
import fsdp_overlap, mokgen
from mokgen.api import build_plans
a = fsdp_overlap.parse(["--reserves", "0,8,16"])
print(len(build_plans(fsdp_overlap.plans(a, 2), jobs=32)), "overlap kernels")
PY
el prebuilt
MOKGEN_TEST_STEPS=1000 timeout 200 torchrun --nproc-per-node=2 -m pytest -q -m multigpu \
  tests/test_multigpu.py > $OUT/pytest_multigpu_R2.log 2>&1
el "multigpu tests: $(grep -E 'passed|failed' $OUT/pytest_multigpu_R2.log | tail -1)"
grep -E "^FAILED|after call|Error" $OUT/pytest_multigpu_R2.log | head -8
timeout 200 torchrun --nproc-per-node=2 benchmarks/fsdp_overlap.py --reserves 0,8,16 \
  --trace --out $OUT 2>&1 | grep -v "^W1204\|^{" > $OUT/fsdp_overlap_R2.log
el "overlap"
cat $OUT/fsdp_overlap_R2.log | cut -c1-96 | head -170
