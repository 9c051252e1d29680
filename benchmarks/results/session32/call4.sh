# session 32 call 4 (carry .build/kc; main at 1473010 + benchmarks/energy_step.py): energy a
# training step, ours against autograd grouped_mm at the power cap (NVML's counter), then
# ncu's DRAM and L2 bytes of one step of each side (Mixtral-8x22B, N 4096)
export PYTHONPATH=$PWD TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export MOKGEN_CACHE=$PWD/.build/kc
nvidia-smi --query-gpu=name,clocks.sm,power.limit,power.draw --format=csv,noheader
for m in mixtral-8x22b mixtral-8x7b; do
  timeout 100 python3 benchmarks/energy_step.py $m 4096 --seconds 3 --out $OUT 2>&1 | tail -3
done
M=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,gpu__time_duration.sum
for side in ours grouped; do
  timeout 150 /usr/local/cuda/bin/ncu --profile-from-start off --metrics $M --csv \
    --log-file $OUT/ncu_$side.csv python3 benchmarks/energy_step.py mixtral-8x22b 4096 \
    --profile $side > $OUT/ncu_$side.log 2>&1; echo "ncu $side: exit $?"
done
python3 - $OUT <<'PY'
import csv, collections, sys, os
for side in ("ours", "grouped"):
    p = os.path.join(sys.argv[1], f"ncu_{side}.csv")
    if not os.path.exists(p):
        print(side, "no csv"); continue
    lines = open(p).read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        print(side, "no rows:", lines[:3]); continue
    per = collections.defaultdict(lambda: collections.defaultdict(float)); n = collections.Counter()
    ids = set()
    for r in csv.DictReader(lines[start:]):
        k = r["Kernel Name"][:60]
        v = float(r["Metric Value"].replace(",", ""))
        u = r["Metric Unit"]
        scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
                 "nsecond": 1e-3, "usecond": 1, "msecond": 1e3, "second": 1e6}.get(u, 1)
        per[k][r["Metric Name"]] += v * scale
        if (r["ID"], k) not in ids:
            ids.add((r["ID"], k)); n[k] += 1
    tot = collections.defaultdict(float)
    print(f"== {side}: kernel | launches | DRAM read GB | DRAM write GB | L2 GB | us (ncu clocks)")
    for k, m in sorted(per.items(), key=lambda kv: -kv[1]["gpu__time_duration.sum"]):
        for name, v in m.items(): tot[name] += v
        print(f"{k} | {n[k]} | {m['dram__bytes_read.sum']/1e9:.3f} | {m['dram__bytes_write.sum']/1e9:.3f}"
              f" | {m['lts__t_bytes.sum']/1e9:.2f} | {m['gpu__time_duration.sum']:.0f}")
    print(f"{side} total | | {tot['dram__bytes_read.sum']/1e9:.3f} | {tot['dram__bytes_write.sum']/1e9:.3f}"
          f" | {tot['lts__t_bytes.sum']/1e9:.2f} | {tot['gpu__time_duration.sum']:.0f}")
PY
# output: see call4/ (energy_*.json, ncu_*.csv) and NOTES session 32
