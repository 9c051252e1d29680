"""The minibatch (rows a ring slot holds, the unit the task list walks) against the pass's
choice, whole layers on one GPU, forward and training step, in one process: each model's
variants run in turn, twice (default v1 v2 ... default v1 v2 ...), so drift hits all alike;
per variant the medians of its runs, and the pass's time over its own.

    python benchmarks/minibatch_sweep.py MODEL[@EP[@TOKENS]]:MB,MB,... [...] [--ep 1]
        [--tokens 4096] [--reps 2] [--iters 20] [--out DIR]

(EP and TOKENS per spec default to --ep / --tokens; ep > 1 is rank 0's slice of a virtual
deployment, as benchmarks/models.py.)

Prebuild the kernels here first (nvcc, no GPU) with `--prebuild`: the same arguments.
Writes DIR/minibatch_sweep.json."""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mokgen  # noqa: E402


def parse(specs, ep, tokens):
    """[(model, ep, tokens, [0, MB, ...])]: 0 is the pass's minibatch."""
    out = []
    for s in specs:
        head, _, mbs = s.partition(":")
        name, *rest = head.split("@")
        out.append((name, int(rest[0]) if rest else ep,
                    int(rest[1]) if len(rest) > 1 else tokens,
                    [0] + [int(m) for m in mbs.split(",") if m]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--prebuild", action="store_true")
    a = ap.parse_args(argv)
    specs = parse(a.specs, a.ep, a.tokens)
    if a.prebuild:
        from mokgen.pytorch.api import build_plans
        from mokgen.compiler.tuned import tuned_plan
        for name, ep, n, mbs in specs:
            for mb in mbs:
                over = dict(minibatch=mb) if mb else {}
                plan = tuned_plan(mokgen.shapes.get(name), ep, "bf16", n, **over)
                build_plans([plan])
                print(f"{name} ep {ep} N {n} minibatch {plan.minibatch}: built", flush=True)
        return 0

    import torch
    from mokgen.harness.bench import bench_one
    g = torch.Generator(device="cuda").manual_seed(0)
    runs: dict = {}
    for name, ep, n, mbs in specs:
        for _ in range(a.reps):
            for mb in mbs:
                over = dict(minibatch=mb) if mb else {}
                r = bench_one(name, ep, n, a.iters, g, backward=True, naive=False, **over)
                b = r["backward"]
                row = dict(minibatch=r["plan"]["minibatch"], fwd=r["mokgen_ms"],
                           bwd=b["mokgen_ms"], train=r["mokgen_ms"] + b["mokgen_ms"],
                           x_train=(r["grouped_ms"] + b["grouped_ms"]) /
                           (r["mokgen_ms"] + b["mokgen_ms"]),
                           x_fwd=r["grouped_ms"] / r["mokgen_ms"], err=r["err_vs_grouped"])
                runs.setdefault((name, ep, n, mb), []).append(row)
                print(json.dumps(dict(shape=name, ep=ep, tokens=n, **row)), flush=True)
                gc.collect()
                torch.cuda.empty_cache()
    rows = []
    for (name, ep, n, mb), rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("fwd", "bwd", "train",
                                                                "x_train", "x_fwd")}
        rows.append(dict(shape=name, ep=ep, tokens=n, forced=mb, minibatch=rs[0]["minibatch"],
                         runs=len(rs), err=max(r["err"] for r in rs), **med))
    key = lambda r: (r["shape"], r["ep"], r["tokens"])  # noqa: E731
    base = {key(r): r for r in rows if r["forced"] == 0}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "minibatch_sweep.json"), "w") as f:
        json.dump(dict(commit=os.environ.get("MOKGEN_COMMIT", ""), rows=rows), f, indent=1)
    # pass / this: the pass's time over this minibatch's (below 1: the pass's choice is faster)
    print("| model | ep | N | minibatch | fwd ms | bwd ms | train ms | fwd pass / this | "
          "train pass / this | train x grouped_mm |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = base[key(r)]
        tag = "" if r["forced"] else " (pass)"
        print(f"| {r['shape']} | {r['ep']} | {r['tokens']} | {r['minibatch']}{tag} | "
              f"{r['fwd']:.3f} | {r['bwd']:.3f} | {r['train']:.3f} | "
              f"{d['fwd'] / r['fwd']:.3f} | {d['train'] / r['train']:.3f} | "
              f"{r['x_train']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
