#!/usr/bin/env bash
# Two trees' whole layers timed in one device call (benchmarks/models.py: forward and training
# step against autograd through torch._grouped_mm, same inputs), in alternating processes
# base NAME NAME base so drift hits both alike: this tree (cache .build/kc) and another
# exported under .build/ab/NAME (cache .build/ab/NAME/kc), made here by lab/prepare_ab.sh
# (which also builds both trees' kernels: `... --models MODEL,... EP TOKENS`);
# then, carrying .build:  bash lab/ab_models.sh NAME MODEL,MODEL... [EP] [TOKENS]
# OTHER_ARGS="--gemm-bwd 128x256x4-solo": models.py arguments of the NAME side only (a plan
# option against the default: NAME then holds the same tree, prebuilt with the same args).
# ARGS="--sustained 2": models.py arguments of both sides (the summary then adds the
# training step back to back at the power cap).
# Per side and model: the medians of its two runs; last, NAME / base per model, of mokgen's
# TFLOP/s and of its ratio to grouped_mm in the same process (on small layers the processes'
# clocks move mokgen's own TFLOP/s as much as a change does; the ratio is the steadier one).
set -uo pipefail
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
NAME=${1:?usage: ab_models.sh NAME MODELS [EP] [TOKENS]}
MODELS=${2:?models}
EP=${3:-1}
TOKENS=${4:-4096}
ROOT=$PWD
OTHER=$ROOT/.build/ab/$NAME
[ -d "$OTHER" ] || { echo "no $OTHER: export the other tree there first"; exit 2; }
[ "$NAME" != base ] || { echo "NAME base is this tree's label: name the other tree otherwise"; exit 2; }
i=0
for side in base "$NAME" "$NAME" base; do
  i=$((i + 1))
  dir=$ROOT; cache=$ROOT/.build/kc; args=${ARGS:-}
  [ "$side" = base ] || { dir=$OTHER; cache=$OTHER/kc; args="${ARGS:-} ${OTHER_ARGS:-}"; }
  mkdir -p "$OUT/models_${side}_$i"
  (cd "$dir" && PYTHONPATH=$dir MOKGEN_CACHE=$cache timeout ${RUN_TIMEOUT:-240} \
    python3 benchmarks/models.py --models "$MODELS" --ep "$EP" --tokens "$TOKENS" \
    --out "$OUT/models_${side}_$i" $args > "$OUT/models_${side}_$i.log" 2>&1)
  echo "== $side run $i: exit $?"
done
python3 - "$OUT" "$NAME" <<'PY'
import glob, json, os, statistics, sys
out, name = sys.argv[1], sys.argv[2]
med = {}
for side in ("base", name):
    runs = {}
    for f in glob.glob(os.path.join(out, f"models_{side}_*", "models.json")):
        for r in json.load(open(f))["rows"]:
            runs.setdefault((r["shape"], r["ep"]), []).append(r)
    for key, rs in runs.items():
        f3 = 3 * rs[0]["flops"] / 1e9
        m = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        med[side, key] = dict(fwd=rs[0]["flops"] / 1e9 / m("mokgen_ms"),
                              train=f3 / m("train_mokgen_ms"),
                              x_fwd=m("grouped_ms") / m("mokgen_ms"),
                              x_train=m("train_grouped_ms") / m("train_mokgen_ms"),
                              err=max(r["err_vs_grouped"] for r in rs), runs=len(rs))
        if "mokgen_train_sustained_ms" in rs[0]["backward"]:  # ARGS=--sustained
            ms = lambda k: statistics.median(r["backward"][k] for r in rs)  # noqa: E731
            med[side, key].update(capped=f3 / ms("mokgen_train_sustained_ms"),
                                  x_capped=ms("grouped_train_sustained_ms")
                                  / ms("mokgen_train_sustained_ms"))
print(f"| model | ep | side | fwd TFLOP/s | x grouped_mm | train TFLOP/s | x grouped_mm | err |")
print("|---|---|---|---|---|---|---|---|")
for (side, key), v in sorted(med.items(), key=lambda kv: (kv[0][1], kv[0][0] != "base")):
    print(f"| {key[0]} | {key[1]} | {side} | {v['fwd']:.0f} | {v['x_fwd']:.3f} | "
          f"{v['train']:.0f} | {v['x_train']:.3f} | {v['err']:.1e} |"
          + (f" capped train {v['capped']:.0f}, x grouped_mm {v['x_capped']:.3f}"
             if "capped" in v else ""))
for (side, key), v in med.items():
    if side == name and ("base", key) in med:
        b = med["base", key]
        # both: mokgen's own ratio moves with the processes' clocks (small layers: as much
        # as the change), the x grouped_mm ratio with the baseline's noise; trust agreement
        print(f"{key[0]} ep {key[1]}: {name}/base fwd {v['fwd'] / b['fwd']:.3f} "
              f"train {v['train'] / b['train']:.3f}; x grouped_mm {name}/base fwd "
              f"{v['x_fwd'] / b['x_fwd']:.3f} train {v['x_train'] / b['x_train']:.3f}"
              + (f"; capped train {v['capped'] / b['capped']:.3f}"
                 if "capped" in v and "capped" in b else ""))
json.dump({f"{s}|{k[0]}|{k[1]}": v for (s, k), v in med.items()},
          open(os.path.join(out, f"ab_models_{name}.json"), "w"), indent=1)
PY
