"""Where a training step's memory peak falls and what is live there (issue #17's memory
target; benchmarks/NOTES.md, session 14, item 7). peers_sonicmoe.py measures the peak of a
step; this says which phase holds it (forward or backward) and the largest blocks live at
that moment, each with where it was allocated.

For mokgen (copied rows, and gathered: dispatch="gather") and SonicMoE where it imports, at
issue #17's shapes (ep = 1): the allocator's history is recorded from before the layer is
built (`torch.cuda.memory._record_memory_history`). A step runs with gradients set to None
(the fresh-gradient column), with marker allocations between its forward and backward. Then
the trace is walked: bytes live after each event, the step's largest, its phase, and the
live blocks there grouped by allocation site (the innermost frame in mokgen, sonicmoe or
quack; else the innermost Python frame).

    here:   MOKGEN_CACHE=$PWD/.kcache python benchmarks/peak_phases.py --prebuild
    device: bash benchmarks/peers_sonicmoe.sh peaks [shapes]   (after its `stage` call;
            or python benchmarks/peak_phases.py [--shapes qwen3-30b-a3b] for mokgen alone)
Writes OUT/peak_phases.json; a table per layer is printed last."""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

MARK = "_mark_here"  # the marker allocations' function, found by name in their frames
OURS = ("/mokgen/", "/sonicmoe/", "/quack/")


def _mark_here():
    """A tiny allocation freed at once: in the trace, where a phase begins."""
    t = torch.empty(512, dtype=torch.uint8, device="cuda")
    del t


def site(frames: list) -> str:
    """The allocation's site: the innermost frame in mokgen / sonicmoe / quack, else the
    innermost Python frame, as file:line (function)."""
    py = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    ours = [f for f in py if any(o in str(f["filename"]) for o in OURS)]
    f = (ours or py or frames or [None])[0]
    return f"{os.path.basename(str(f['filename']))}:{f['line']} ({f['name']})" if f else "?"


def _is_mark(e: dict) -> bool:
    return e["action"] == "alloc" and any(f.get("name") == MARK for f in e.get("frames", []))


def walk(trace: list, top: int = 12) -> dict:
    """The peak of live bytes over `trace` (one device's TraceEntry list, in order) between
    its first and last marker allocation, with the phase it falls in (markers split the
    window: phase i after marker i) and the `top` allocation sites by live bytes there.
    A block counts from its alloc to its free_requested (when the tensor was freed)."""
    live, total = {}, 0
    marks = [i for i, e in enumerate(trace) if _is_mark(e)]
    if len(marks) < 2:
        raise ValueError("the trace has fewer than two phase markers")
    best = (-1, -1, {})  # (bytes, index, live blocks)
    for i, e in enumerate(trace):
        a = e["action"]
        if a == "alloc" and not _is_mark(e):
            live[e["addr"]] = e
            total += e["size"]
        elif a == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        if marks[0] < i < marks[-1] and total > best[0]:
            best = (total, i, dict(live))
    peak, at, blocks = best
    phase = sum(m < at for m in marks) - 1
    by_site: dict = {}
    for e in blocks.values():
        s = site(e.get("frames", []))
        by_site[s] = by_site.get(s, 0) + e["size"]
    sites = sorted(by_site.items(), key=lambda kv: -kv[1])[:top]
    return {"peak_bytes": peak, "phase": phase, "event": at,
            "sites": [{"site": s, "bytes": b} for s, b in sites]}


def record_step(make, T: int, D: int) -> dict | None:
    """The layer `make()` builds, called once to build its kernels and workspace, then one
    fresh-gradient step between markers (0: forward, 1: backward); the allocator's trace of
    all of it, walked."""
    gc.collect()
    torch.cuda.empty_cache()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=1_000_000)
    try:
        built = make()
        if built is None:
            return None
        layer, call = built
        xg = x.detach().requires_grad_()
        call(xg).backward(dy)  # kernels, workspace, the JIT of SonicMoE's backward
        layer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        xg = x.detach().requires_grad_()
        _mark_here()
        y = call(xg)
        torch.cuda.synchronize()
        _mark_here()
        y.backward(dy)
        torch.cuda.synchronize()
        _mark_here()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    dev = torch.cuda.current_device()
    out = walk(snap["device_traces"][dev])
    params = sum(p.numel() * p.element_size() for p in layer.parameters())
    out["params_bytes"] = params  # the weights; their gradients are as large again
    del layer, call, built, y
    return out


def main(argv=None):
    from peers_sonicmoe import SHAPES, mokgen_shape, sonicmoe_layer

    import mokgen

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-30b-a3b")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--prebuild", action="store_true",
                    help="only compile mokgen's kernels of both layers (no GPU needed)")
    a = ap.parse_args(argv)
    wanted = [s for s in SHAPES if s[0] in a.shapes.split(",")]
    if a.prebuild:
        from mokgen.pytorch.api import build_plans
        from mokgen.compiler.tuned import tuned_plan
        bins = build_plans([tuned_plan(mokgen_shape(D, I, E, k), 1, "bf16", T, **o)
                            for _, T, D, I, E, k in wanted for o in ({}, {"dispatch": "gather"})],
                           jobs=os.cpu_count())
        print(f"prebuild: {len(bins)} kernels, {sum(not b.cached for b in bins)} built")
        return
    rows = []
    for name, T, D, I, E, k in wanted:
        def ours(**overrides):  # the planner's dispatch (copied rows), or dispatch="gather"
            def make():
                layer = mokgen.MoE(mokgen_shape(D, I, E, k), tokens_per_rank=T,
                                   **overrides, device="cuda").to(torch.bfloat16)
                return layer, layer
            return make
        for label, make in (("mokgen copied", ours()), ("mokgen gathered", ours(dispatch="gather")),
                            ("SonicMoE", lambda: sonicmoe_layer(D, I, E, k))):
            r = record_step(make, T, D)
            if r is None:
                continue
            rows.append({"shape": name, "layer": label, **r})
            print(f"\n{name}, {label}: peak {r['peak_bytes'] / 2**20:,.0f} MiB live in the "
                  f"{('forward', 'backward')[r['phase']]} (weights {r['params_bytes'] / 2**20:,.0f}"
                  f" MiB, their gradients as much again)\n| site | MiB |\n|---|---|", flush=True)
            for s in r["sites"]:
                print(f"| {s['site']} | {s['bytes'] / 2**20:,.1f} |")
    with open(os.path.join(a.out, "peak_phases.json"), "w") as fh:
        json.dump({"rows": rows, "gpu": torch.cuda.get_device_name()}, fh, indent=1)


if __name__ == "__main__":
    main()
