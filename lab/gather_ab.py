"""One rank, bf16: the layer with dispatch="gather" (gathered rows: the GEMMs read x and dy
where they are, no comm CTAs, no x or dy ring; mokgen/compiler/limits.py GATHER), with the forward
gathering alone ("fwd-gather": reverse_combine="pull", the backward's comm CTAs pull x and dy,
x into a window of a few minibatches: passes/x_window.py; "fwd-gather-whole": into the ring)
and with the rows copied into rings by comm CTAs (dispatch="pull", reverse_combine="pull":
the default plan, whose dx rows stay in its dy ring: reverse_dispatch "ring",
mokgen/compiler/passes/dx_rows.py; "pull-push" pushes them into the combine rows instead), on
SonicMoE's five shapes (peers_sonicmoe.SHAPES). Same inputs, same
process, each variant measured twice in mirrored order (ABBA), medians of medians: forward and
training-step TFLOP/s, peak MB (as peers_sonicmoe.measure: workspace included), and the step
with fresh gradients; with --sustained S also both back to back for S seconds, at the power
cap (the short synced loops run partly before it). Prints a table; writes OUT/gather_ab.json.

    python3 lab/gather_ab.py --out $OUT [--shapes qwen3-30b-a3b,...]
        [--variants gather,fwd-gather,fwd-gather-whole,pull,pull-push] [--prebuild]
    (a variant may force plan fields: fwd-gather+comm_sms_bwd=8)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import mokgen  # noqa: E402
from peers_sonicmoe import SHAPES, measure  # noqa: E402

PULL = dict(dispatch="pull", reverse_combine="pull")
VARIANTS = {"gather": dict(dispatch="gather"),
            # the forward gathers, the backward copies x and dy rows into rings (XPULL)
            "fwd-gather": dict(dispatch="gather", reverse_combine="pull"), "pull": PULL,
            # ... its x ring the ring's, not a window (passes/x_window.py)
            "fwd-gather-whole": dict(dispatch="gather", reverse_combine="pull", x_slots=1 << 20),
            "pull-push": dict(PULL, reverse_dispatch="push")}


def variant(spec: str) -> dict:
    """A variant's overrides: NAME, or NAME+field=value[+...] (NAME's with plan fields forced,
    ints as ints, true / false as bools, a:b:c as a tuple), e.g. fwd-gather+comm_sms_bwd=8,
    pull+keep_h=true, pull+gemm_fwd=128:256:3."""
    name, *extra = spec.split("+")
    kv = dict(e.split("=", 1) for e in extra)
    bools = {"true": True, "false": False}

    def value(v: str):  # 128:256:3 is a tuple (gemm_fwd, gemm_bwd)
        if ":" in v:
            return tuple(value(e) for e in v.split(":"))
        return int(v) if v.lstrip("-").isdigit() else bools.get(v, v)
    return dict(VARIANTS[name], **{k: value(v) for k, v in kv.items()})


def layer(D, I, E, k, T, **overrides):
    m = mokgen.MoE(mokgen.MoEShape(E, D, I, k, shared_experts=0), tokens_per_rank=T,
                   **overrides, device="cuda").to(torch.bfloat16)
    return m, m


def prebuild(shapes, variants) -> None:
    from mokgen.pytorch.api import build_plans
    from mokgen.compiler.tuned import tuned_plan
    bins = build_plans([tuned_plan(mokgen.MoEShape(E, D, I, k, shared_experts=0), 1, "bf16", T,
                                   **over)
                        for _, T, D, I, E, k in shapes for over in variants.values()],
                       jobs=os.cpu_count())
    print(f"prebuild: {len(bins)} kernels, {sum(not b.cached for b in bins)} built")


def selection_args(ap, variants: str, help: str) -> None:
    """--shapes, --iters, --variants (default `variants`) and --prebuild, read by selected."""
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", default=variants, help=help)
    ap.add_argument("--prebuild", action="store_true")


def selected(a) -> tuple[list, dict]:
    """(SHAPES named by a.shapes, {variant: its overrides} of a.variants)."""
    return [s for s in SHAPES if s[0] in a.shapes.split(",")], \
        {v: variant(v) for v in a.variants.split(",")}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    selection_args(ap, ",".join(VARIANTS),
                   "of " + ", ".join(VARIANTS) + " (each run in a mirrored order)")
    ap.add_argument("--sustained", type=float, default=0.0, metavar="S",
                    help="also the forward and the training step back to back for S seconds "
                         "each (at the power cap: peers_sonicmoe.measure)")
    a = ap.parse_args(argv)
    shapes, variants = selected(a)
    if a.prebuild:
        prebuild(shapes, variants)
        return 0
    from mokgen.harness.bench import results_commit
    rows = []
    for name, T, D, I, E, k in shapes:
        flops = 6 * T * k * D * I
        got = {v: [] for v in variants}
        capped = {v: [] for v in variants}
        for v in [*variants, *reversed(variants)]:  # ABBA: drift hits all alike
            extra = {}
            got[v].append(measure(lambda: layer(D, I, E, k, T, **variants[v]), T, D, a.iters,
                                  a.sustained, extra))
            capped[v].append(extra)
        med = {v: [statistics.median(r[i] for r in runs) for i in range(5)]
               for v, runs in got.items()}
        row = dict(shape=name, T=T, D=D, I=I, E=E, k=k)
        for v, (fwd, train, peak, fresh, peak_fresh) in med.items():
            row.update({f"{v}_fwd_tflops": flops / fwd / 1e9,
                        f"{v}_train_tflops": 3 * flops / train / 1e9,
                        f"{v}_fresh_tflops": 3 * flops / fresh / 1e9,
                        f"{v}_peak_mb": peak, f"{v}_peak_fresh_mb": peak_fresh})
            if a.sustained > 0:  # the two runs' mean: each is already a long average
                for key, f in (("fwd", flops), ("train", 3 * flops)):
                    ms = [e[f"{key}_sustained_ms"] for e in capped[v]]
                    row[f"{v}_{key}_sustained_tflops"] = f / statistics.mean(ms) / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gather_ab.json"), "w") as f:
        json.dump(dict(commit=results_commit(), gpu=torch.cuda.get_device_name(),
                       torch=torch.__version__, rows=rows), f, indent=1)
    names = " / ".join(variants)
    print(f"| shape | fwd {names} | train {names} | fresh {names} | peak MB {names} "
          f"| fresh peak MB {names} |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cell = lambda k, f="{:.0f}": " / ".join(f.format(r[f"{v}_{k}"]) for v in variants)  # noqa
        print(f"| {r['shape']} | {cell('fwd_tflops')} | {cell('train_tflops')} "
              f"| {cell('fresh_tflops')} | {cell('peak_mb')} | {cell('peak_fresh_mb')} |")
    if a.sustained > 0:
        print(f"\nback to back for {a.sustained:g} s (power-capped): fwd {names} | train {names}")
        print("|---|---|---|")
        for r in rows:
            cell = lambda k: " / ".join(f"{r[f'{v}_{k}']:.0f}" for v in variants)  # noqa
            print(f"| {r['shape']} | {cell('fwd_sustained_tflops')} "
                  f"| {cell('train_sustained_tflops')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
