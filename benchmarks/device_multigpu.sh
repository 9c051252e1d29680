#!/usr/bin/env bash
# One device call on a multi-GPU machine (nvidia-h200-x2; x4/x8 run the same at R = 4 / 8):
#   1. compile ahead every kernel (benchmarks/prebuild.py: nvcc in parallel; a carried
#      .mokgen-cache/ whose keys match makes this a no-op)
#   2. torchrun --nproc-per-node=R -m pytest -q -m multigpu tests/test_multigpu.py
#      (a rank killed mid-training: benchmarks/device_faults.sh, its own call)
#   3. benchmarks/multigpu.py (forward + training step vs NCCL all_to_all + grouped_mm, floors)
#   4. benchmarks/fsdp_overlap.py (a 256 MiB all-gather beside the layer, reserve 0 and 16)
#   5. examples/04_train_fsdp_ep.py: FSDP2 + EP = 2 through mokgen.MoE, loss vs the
#      single-process reference, tokens/s vs the torch-native EP layer (FSDP_EXAMPLE=0 skips)
#   6. a short table: the results, and the simulator's error against them
# JSON and logs go to $OUT (and benchmarks/results/). NVLink multicast stays off.
# Usage: MOKGEN_COMMIT=<sha> bash benchmarks/device_multigpu.sh [tokens, default 2048]
# Expected at R = 2: prebuild ~0 with a carried .mokgen-cache/ (1-2 min on 32 cores without),
# tests ~1 min plus the 10,000 training calls (TEST_STEPS=1000 shortens them), benchmark
# ~1.5 min at one N (8 rows; "2048,4096" doubles it), overlap ~0.5 min.
# Each step has a timeout; with TEST_STEPS=1000 the whole stays under ~9 min even if one hangs.
source "$(dirname "$0")/device_env.sh"
mkdir -p benchmarks/results
TOKENS=${1:-2048}
GPUS=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
nvidia-smi topo -m | head -6
SIZES=""
for R in 2 4 8; do [ "$R" -le "$GPUS" ] && SIZES="$SIZES $R"; done
for R in $SIZES; do
  echo "== prebuild, world size $R ($MOKGEN_CACHE)"
  timeout 150 python3 benchmarks/prebuild.py --world "$R" --tokens "$TOKENS" 2>&1 | tail -3
done
for R in $SIZES; do
  echo "== tests, world size $R"
  MOKGEN_TEST_STEPS=${TEST_STEPS:-10000} timeout 300 torchrun --nproc-per-node=$R -m pytest \
    -q -m multigpu tests/test_multigpu.py \
    2>&1 | tee "$OUT/pytest_multigpu_R$R.log" | grep -E "passed|failed|error|Error" | tail -6
done
for R in $SIZES; do
  echo "== EP benchmark, R = $R"
  timeout 200 torchrun --nproc-per-node=$R benchmarks/multigpu.py --tokens "$TOKENS" \
    --out "$OUT" 2>&1 | tee "$OUT/bench_multigpu_R$R.log" | grep -v '^{' | tail -22
  echo "== FSDP-style gather beside the layer, R = $R"
  timeout 90 torchrun --nproc-per-node=$R benchmarks/fsdp_overlap.py --out "$OUT" 2>&1 \
    | tee "$OUT/fsdp_overlap_R$R.log" | grep -v '^{' | tail -7
done
if [ "${FSDP_EXAMPLE:-1}" = 1 ] && [ "$GPUS" -ge 2 ]; then  # ~1 min; FSDP_EXAMPLE=0 skips
  echo "== FSDP2 + EP = 2 training example (examples/04_train_fsdp_ep.py)"
  timeout 70 torchrun --nproc-per-node=2 examples/04_train_fsdp_ep.py --moe mokgen --steps 100 \
    --out "$OUT/train_fsdp_ep2_vs_reference.json" > "$OUT/train_fsdp_ep2.log" 2>&1
  for MOE in mokgen torch; do  # tokens/s without the reference beside it
    timeout 45 torchrun --nproc-per-node=2 examples/04_train_fsdp_ep.py --moe $MOE --steps 100 \
      --no-reference --out "$OUT/train_fsdp_ep2_$MOE.json" >> "$OUT/train_fsdp_ep2.log" 2>&1
  done
  grep -iE "error|Traceback" "$OUT/train_fsdp_ep2.log" | head -5
fi
cp "$OUT"/moe_layer_multigpu_R*.json "$OUT"/fsdp_overlap_R*.json benchmarks/results/ 2>/dev/null
echo "== simulator (h200-nvl8) vs measured"
python3 -m mokgen simulate --validate --results "$OUT" | tee "$OUT/simulate_validate.txt" \
  | tail -4
echo "== summary"
python3 - "$OUT" <<'EOF'
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/moe_layer_multigpu_R*.json")):
    d = json.load(open(f))
    print(f"{f.split('/')[-1]}: {d['meta']['gpu']}, NCCL a2a {d['nvlink_gbps_measured']:.0f} GB/s")
    print(f"{'shape':<18}{'load':>5}{'N':>6} {'fwd x':>6} {'%floor':>6} {'train x':>7} {'%floor':>6}")
    for r in d["rows"]:
        print(f"{r['shape']:<18}{r['load']:>5}{r['tokens']:>6} "
              f"{r['nccl_grouped_fwd_ms'] / r['mokgen_fwd_ms']:6.2f} "
              f"{100 * r['floor_fwd_ms'] / r['mokgen_fwd_ms']:6.0f} "
              f"{r['nccl_grouped_train_ms'] / r['mokgen_train_ms']:7.2f} "
              f"{100 * r['floor_train_ms'] / r['mokgen_train_ms']:6.0f}")
for name in ("vs_reference", "mokgen", "torch"):
    try:
        d = json.load(open(f"{sys.argv[1]}/train_fsdp_ep2_{name}.json"))
    except OSError:
        continue
    gap = f", max loss gap to the reference {d['max_rel_gap']:.2e}" if "max_rel_gap" in d else ""
    print(f"FSDP2+EP2 example ({name}): {d['moe']}, {d['tokens_per_s']:.0f} tokens/s, "
          f"loss {d['first']:.3f} -> {d['last']:.3f}{gap}")
for f in sorted(glob.glob(f"{sys.argv[1]}/fsdp_overlap_R*.json")):
    for r in json.load(open(f))["rows"]:
        ok = "ok" if r["overlap_ms"] <= r["target_ms"] else "MISS"
        print(f"overlap reserve {r['reserve_sms']:>2} {r['mode']:>5}: layer {r['layer_ms']:.2f} "
              f"gather {r['gather_ms']:.2f} both {r['overlap_ms']:.2f} ms "
              f"(target {r['target_ms']:.2f}: {ok})")
EOF
