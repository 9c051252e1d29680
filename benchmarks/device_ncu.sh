#!/usr/bin/env bash
# One device call: ncu's warp-state and source counters of one megakernel launch for each
# profile given as "NAME KERNEL SHAPE TOKENS [KEY=VALUE ...]" (benchmarks/ncu_step.py runs the
# steps; KERNEL mokgen_fwd or mokgen_bwd; the second step's launch is taken). Kernels come
# prebuilt in the carried .build/kc (ncu_step.py --prebuild here). Per profile $OUT gets
# NAME.top (benchmarks/ncu_top.py), the SASS CSVs in ncu.tar.gz and the reports under 15 MB.
# Source lines, here: `nvdisasm -g -c` of the same cubin (.build/kc), then
# `ncu_top.py NAME.csv --sass that-listing`.
#   bash benchmarks/device_ncu.sh "mx mokgen_bwd mixtral-8x22b 4096" "qg mokgen_bwd qwen3-30b-a3b 8192 dispatch=gather"
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOKGEN_CACHE=${MOKGEN_CACHE:-$PWD/.build/kc}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
mkdir -p "$OUT" /tmp/ncu
nvidia-smi --query-gpu=name,clocks.sm,power.draw,memory.used --format=csv,noheader
for spec in "$@"; do
  read -r name kernel shape tokens over <<< "$spec"
  t0=$(date +%s)
  timeout ${NCU_TIMEOUT:-240} "$NCU" --kernel-name "regex:^$kernel" --launch-skip 1 \
    --launch-count 1 --section WarpStateStats --section SourceCounters \
    --section SpeedOfLight -o "/tmp/ncu/$name" -f \
    python3 benchmarks/ncu_step.py "$shape" "$tokens" $over --steps 2 > "/tmp/ncu/$name.log" 2>&1
  echo "== $name ($kernel $shape $tokens $over): exit $?, $(( $(date +%s) - t0 )) s"
  tail -3 "/tmp/ncu/$name.log"
  "$NCU" -i "/tmp/ncu/$name.ncu-rep" --page source --csv --print-source sass > "/tmp/ncu/$name.csv"
  "$NCU" -i "/tmp/ncu/$name.ncu-rep" --page details > "/tmp/ncu/$name.details" 2>&1
  python3 benchmarks/ncu_top.py "/tmp/ncu/$name.csv" --top ${TOP:-60} > "$OUT/$name.top" 2>&1
  head -30 "$OUT/$name.top"
done
# the SASS CSVs, details and logs (reports are large: only those under 15 MB come back)
tar -C /tmp/ncu -czf "$OUT/ncu.tar.gz" --exclude '*.ncu-rep' .
find /tmp/ncu -name '*.ncu-rep' -size -15M -exec cp {} "$OUT"/ \;
ls -la "$OUT"
