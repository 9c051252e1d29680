"""Where a lone mokgen.MoE call's time goes, bf16 against fp8 (a device call; issue 63's open
question: the peers benchmark's fp8 forward is 2.16 ms synced against 1.57 ms back to back on
the H100, bf16 1.78 / 1.68). For each dtype, the layer as peers_sonicmoe.py builds it:
- host: the call's launch time on the host (perf_counter, no sync; the GPU idle before it);
- synced: CUDA events around the call, the GPU idle before it (peers' synced column);
- queued: the same behind a GPU sleep, so the host has queued everything: the GPU alone;
- the kernels of one call (torch.profiler): name, start and length in us;
then the same three for a training step (forward + backward), with the weights' version
bumped before each step as an optimizer step does (fp8 quantizes them again).
If host > queued for fp8 only, the gap is host work; if queued alone is long, a kernel.

    python lab/lone_call.py [--shape qwen3-30b-a3b] [--tokens 8192] [--iters 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.autograd.graph import increment_version

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mokgen  # noqa: E402
from mokgen.harness.bench import kernel_times, short_kernel_name, time_ms  # noqa: E402


def host_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    shape = mokgen.shapes.get(a.shape)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(a.tokens, shape.hidden, device="cuda", generator=g).bfloat16()
    dy = torch.randn_like(x)
    rows = []
    for dtype in ("bf16", "fp8"):
        layer = mokgen.MoE(shape, tokens_per_rank=a.tokens, dtype=dtype,
                           device="cuda").to(torch.bfloat16)
        weights = list(layer.parameters())

        def step():
            for w in weights:
                increment_version(w)
            layer(x.detach().requires_grad_()).backward(dy)

        with torch.no_grad():
            fwd = lambda: layer(x)  # noqa: E731
            fwd()
            cols = [host_ms(fwd, a.iters), time_ms(fwd, a.iters, warmup=3),
                    time_ms(fwd, a.iters, warmup=3, queue_ahead=True)]
            kernels = kernel_times(lambda: None, fwd)
        step()
        cols += [host_ms(step, a.iters), time_ms(step, a.iters, warmup=3),
                 time_ms(step, a.iters, warmup=3, queue_ahead=True)]
        rows.append((dtype, cols))
        print(f"{dtype}: one forward's kernels (name, start us, us):")
        for name, start, us in kernels:
            print(f"  {short_kernel_name(name):72s} {start:9.1f} {us:9.1f}")
        layer = weights = None  # the next precision's layer on a freed GPU
        torch.cuda.empty_cache()
    print("\n| dtype | fwd host | fwd synced | fwd queued | step host | step synced "
          "| step queued |  (ms)\n|---|---|---|---|---|---|---|")
    for dtype, cols in rows:
        print(f"| {dtype} | " + " | ".join(f"{c:.3f}" for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
