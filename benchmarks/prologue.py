"""The prologue's kernels, one rank's share (route its tokens; count, offsets, place its
schedule; the backward's segments), per preset at ep = 1 and ep = 8, built alone (no
megakernel: mokgen.harness.standalone). Kernel times from torch.profiler (device time per launch,
mean over the iterations), and the forward's prologue (route + count + offsets + place) timed
whole with CUDA events (median), launch gaps included.

    python benchmarks/prologue.py [--presets qwen3-30b-a3b,...] [--tokens 8192] [--out DIR]
    MOKGEN_CACHE=$PWD/.mokgen-cache python benchmarks/prologue.py --build-only   # no GPU

--build-only compiles the prologues this benchmark and tests/test_gpu_prologue.py run (nvcc
only), into a cache a device call can carry.

Prints a table and writes DIR/prologue_<commit>.json (DIR: --out, else $OUT, else
benchmarks/results)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mokgen  # noqa: E402
from mokgen.harness.bench import results_commit, time_ms  # noqa: E402
from mokgen.harness.standalone import StandalonePrologue  # noqa: E402

KERNELS = ("route", "sched_count", "sched_offsets", "sched_place", "sched_segments")
PRESETS = "qwen3-30b-a3b,qwen3.5-397b-a17b,kimi-k2.7"


def measure(name: str, ep: int, tokens: int, iters: int) -> dict:
    shape = mokgen.shapes.get(name)
    p = StandalonePrologue(mokgen.plan(shape, ep=ep, tokens_per_rank=tokens))
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = [torch.randn(tokens, shape.num_experts, device="cuda", generator=g)
              for _ in range(ep)]
    for r in range(ep):  # every rank's routes in rank 0's table: its schedule sees them all
        p.route(r, logits[r])

    def forward_prologue():  # rank 0's: its tokens routed, its schedule from every rank's
        p.route(0, logits[0])
        p.schedule(0, tokens)

    def step():
        forward_prologue()
        p.segments(0)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    us = {k: [] for k in KERNELS}
    for e in prof.events():
        k = e.name.removeprefix("mokgen_")
        if k in us and e.device_type == torch.autograd.DeviceType.CUDA:
            us[k].append(e.time_range.elapsed_us())  # a kernel's own span on the device
    b = p.ranks[0]
    return {"preset": name, "ep": ep, "tokens_per_rank": tokens, "topk": shape.topk,
            "local_experts": p.spec.local_experts,
            "routes_per_rank": tokens * shape.topk, "rows": int(b.meta[0]),
            "kernel_us": {k: sum(v) / len(v) if v else None for k, v in us.items()},
            "forward_prologue_us": 1e3 * time_ms(forward_prologue, iters)}


def build_only(a) -> None:
    from mokgen.compiler import build, codegen

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from test_gpu_prologue import CASES

    plans = [mokgen.plan(mokgen.shapes.get(n), ep=ep, tokens_per_rank=a.tokens)
             for n in a.presets.split(",") for ep in map(int, a.eps.split(","))]
    plans += [mokgen.plan(mokgen.MoEShape(E, 256, 128, k), ep=ep, tokens_per_rank=t)
              for E, k, ep, t in CASES]
    bins = build.build([k for p in plans for k in codegen.emit(p, units=("prologue",))])
    print(f"{len(bins)} prologues, {sum(not b.cached for b in bins)} built")




def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default=PRESETS)
    ap.add_argument("--eps", default="1,8")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--build-only", action="store_true")
    a = ap.parse_args(argv)
    if a.build_only:
        build_only(a)
        return
    rows = [measure(n, ep, a.tokens, a.iters) for n in a.presets.split(",")
            for ep in map(int, a.eps.split(","))]
    head = f"{'preset':<20}{'ep':>3}{'L':>5}{'routes':>8}" + "".join(
        f"{k.removeprefix('sched_'):>10}" for k in KERNELS) + f"{'fwd us':>9}"
    print(head + "   (device us per launch; fwd: route..place, CUDA events)")
    for r in rows:
        print(f"{r['preset']:<20}{r['ep']:>3}{r['local_experts']:>5}{r['routes_per_rank']:>8}"
              + "".join(f"{r['kernel_us'][k] or float('nan'):>10.1f}" for k in KERNELS)
              + f"{r['forward_prologue_us']:>9.1f}")
    c = results_commit()
    # before the chunked count: torch.profiler in a training step (profile_step_*_22c0a7d)
    before = {"commit": "22c0a7d", "preset": "qwen3-30b-a3b", "ep": 1, "tokens_per_rank": 8192,
              "sched_count_us": 176}
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": c,
           "iters": a.iters, "rows": rows, "before": before}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"prologue_{c}.json")
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
