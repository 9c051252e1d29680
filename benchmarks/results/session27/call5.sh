# session 27, call 5 (nvidia-h200-x2): the faults at R = 2 at the head (10,000 calls, NaN rows,
# a rank SIGKILLed), then the gather beside the layer in event time and GPU time.
source benchmarks/device_env.sh
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 - <<'PY' &
import sys; sys.path.insert(0, "benchmarks")
import fsdp_overlap
from mokgen.api import build_plans
print(len(build_plans(fsdp_overlap.plans(fsdp_overlap.parse(["--reserves", "0,4,8,16"]), 2),
                      jobs=16)), "overlap kernels")
PY
bash benchmarks/device_faults.sh
wait; el faults
timeout 200 torchrun --nproc-per-node=2 benchmarks/fsdp_overlap.py --reserves 0,4,8,16 \
  --out $OUT 2>&1 | grep -v "^W1204\|^{" > $OUT/fsdp_overlap_R2.log
el overlap; cat $OUT/fsdp_overlap_R2.log
