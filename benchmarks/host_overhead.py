"""What a mokgen.MoE call costs the host (issue #17: a Qwen3 step measured 7.24 ms for 6.40 ms
of GPU work). The GPU is kept busy first (torch.cuda._sleep), so every launch is queued at
once and the wall time of the Python call is the host's alone: forward without autograd, the
training step (forward + backward), and the same for a bare nn.Linear as a yardstick; then
cProfile of a few steps (the top functions by own time), the step's wall time against its
GPU time (CUDA events) with the GPU idle before it, and the step replayed from a CUDA graph.

    python benchmarks/host_overhead.py [--shape qwen3-30b-a3b] [--tokens 8192] [--fuse]"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mokgen  # noqa: E402
from mokgen.bench import time_ms  # noqa: E402

BUSY_CYCLES = 200_000_000  # ~0.1 s of GPU sleep: longer than any host call measured here


def host_ms(fn, iters: int) -> float:
    """Median wall ms of fn() while the GPU is busy with earlier work (launches never wait)."""
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        torch.cuda._sleep(BUSY_CYCLES)
        t = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - t))
        torch.cuda.synchronize()
    return statistics.median(out)


def graph_step_ms(step, iters: int) -> float | None:
    """The step captured in a CUDA graph and replayed (the host's part: one launch), or None
    where capture fails (tests/test_gpu_module.py checks replays against eager)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return time_ms(graph.replay, iters, warmup=3)
    except RuntimeError as e:
        print(f"no CUDA graph: {e}", flush=True)
        return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--fuse", action="store_true", help="fuse_grad_accumulation=True")
    a = ap.parse_args(argv)
    shape = mokgen.shapes.get(a.shape)
    layer = mokgen.MoE(shape, tokens_per_rank=a.tokens,
                       fuse_grad_accumulation=a.fuse).to("cuda", torch.bfloat16)
    lin = torch.nn.Linear(shape.hidden, shape.num_experts, bias=False).to("cuda", torch.bfloat16)
    x = torch.randn(a.tokens, shape.hidden, device="cuda").bfloat16()
    dy = torch.randn_like(x)
    xg = x.detach().requires_grad_()

    def fwd():
        with torch.no_grad():
            layer(x)

    def step():
        layer(xg).backward(dy)

    def lin_step():
        lin(xg).sum().backward()

    step()  # kernels loaded, .grad exists, as in training
    lin_step()
    res = dict(shape=a.shape, tokens=a.tokens, fuse=a.fuse,
               host_fwd_ms=host_ms(fwd, a.iters), host_step_ms=host_ms(step, a.iters),
               host_linear_step_ms=host_ms(lin_step, a.iters),
               step_ms=time_ms(step, a.iters, warmup=3))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    torch.cuda.synchronize()
    starts[0].record()
    step()
    starts[1].record()
    torch.cuda.synchronize()
    res["one_step_idle_gpu_ms"] = starts[0].elapsed_time(starts[1])
    res["graph_step_ms"] = graph_step_ms(step, a.iters)
    print(json.dumps(res), flush=True)
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    prof.enable()
    for _ in range(5):
        step()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print("\n".join(line[:150] for line in s.getvalue().splitlines()[:45]))


if __name__ == "__main__":
    main()
