"""What a mokgen.MoE call costs the host (issue #17: a Qwen3 step measured 7.24 ms for 6.40 ms
of GPU work). The GPU is kept busy first (torch.cuda._sleep), so every launch is queued at
once and the wall time of the Python call is the host's alone: forward without autograd, the
training step (forward + backward), and the same for a bare nn.Linear as a yardstick; then
cProfile of a few steps (the top functions by own time), the step's wall time against its
GPU time (CUDA events) with the GPU idle before it, and the step replayed from a CUDA graph.
Last, where the host's time goes inside a step: mokgen's host functions wrapped with wall
clocks (inclusive ms a step; cProfile does not see time spent in Cython, e.g. cuda.bindings).

    python benchmarks/host_overhead.py [--shape qwen3-30b-a3b] [--tokens 8192] [--fuse]
        [--torch-ops]"""
from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import importlib
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
from mokgen.harness.bench import time_ms  # noqa: E402

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


# (module, attribute path) of the host functions a step runs, outermost first
BREAKDOWN = [
    ("mokgen.pytorch.module", "MoE.forward"), ("mokgen.pytorch.ops", "_backward_impl"),
    ("mokgen.pytorch.module", "_LazyKernels.forward"), ("mokgen.pytorch.module", "_LazyKernels.backward"),
    ("mokgen.pytorch.api", "CompiledMoE._checked"), ("mokgen.pytorch.api", "CompiledMoE.backward_raw"),
    ("mokgen.runtime.moe", "ForwardRuntime.forward"), ("mokgen.runtime.moe", "ForwardRuntime.route"),
    ("mokgen.runtime.moe", "ForwardRuntime.route_given"),
    ("mokgen.runtime.moe", "ForwardRuntime.schedule"),
    ("mokgen.runtime.moe", "ForwardRuntime.experts"),
    ("mokgen.runtime.moe", "ForwardRuntime.combine_sum"),
    ("mokgen.runtime.moe", "ForwardRuntime.routes_of"), ("mokgen.runtime.moe", "ForwardRuntime._map"),
    ("mokgen.runtime.moe", "ForwardRuntime.check"),
    ("mokgen.runtime.moe", "ForwardRuntime.router_backward"),
    ("mokgen.runtime.moe_bwd", "BackwardPass.backward"), ("mokgen.runtime.moe_bwd", "BackwardPass._launch"),
    ("mokgen.runtime.cuda", "launch"), ("mokgen.runtime.cuda", "make_tensor_map_3d"),
    ("mokgen.runtime.cuda", "_encode_tiled"), ("mokgen.runtime.abi", "pack"),
    ("mokgen.runtime.abi", "pack_maps"), ("mokgen.runtime.checks", "check_inputs"),
    ("mokgen.reference", "router_backward"),
    ("mokgen.pytorch.ops", "_cast"),
]  # a name a tree lacks is said and skipped (trees compared by ab_host.sh differ)


def breakdown(step, steps: int = 20) -> dict:
    """Inclusive wall ms a step of each BREAKDOWN function (and calls a step), the GPU busy."""
    spent, calls, undo = collections.Counter(), collections.Counter(), []
    for mod_name, path in BREAKDOWN:
        owner = importlib.import_module(mod_name)
        *outer, attr = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        fn = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if fn is None:
            print(f"breakdown: no {mod_name}.{path}", flush=True)
            continue

        def timed(*args, __fn=fn, __key=path, **kwargs):
            t = time.perf_counter()
            try:
                return __fn(*args, **kwargs)
            finally:
                spent[__key] += time.perf_counter() - t
                calls[__key] += 1
        setattr(owner, attr, functools.wraps(fn)(timed))
        undo.append((owner, attr, fn))
    try:
        step()
        spent.clear()
        calls.clear()
        total = 0.0
        for _ in range(steps):
            torch.cuda.synchronize()
            torch.cuda._sleep(BUSY_CYCLES)
            t = time.perf_counter()
            step()
            total += time.perf_counter() - t
        torch.cuda.synchronize()
    finally:
        for owner, attr, fn in undo:
            setattr(owner, attr, fn)
    return {"step": (1e3 * total / steps, 1), **{
        k: (1e3 * spent[k] / steps, calls[k] / steps) for _, k in BREAKDOWN if k in calls}}


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
    ap.add_argument("--torch-ops", action="store_true",
                    help="also torch.profiler's CPU ops by self time a step (torch_op_table)")
    a = ap.parse_args(argv)
    shape = mokgen.shapes.get(a.shape)
    layer = mokgen.MoE(shape, tokens_per_rank=a.tokens,
                       fuse_grad_accumulation=a.fuse, device="cuda").to(torch.bfloat16)
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
    rows = breakdown(step)
    print("| host function | ms a step (inclusive) | calls a step |\n|---|---|---|")
    for k, (ms, n) in rows.items():
        print(f"| {k} | {ms:.3f} | {n:g} |")
    print(json.dumps({"breakdown_ms": {k: round(v[0], 4) for k, v in rows.items()}}), flush=True)
    if a.torch_ops:
        print(torch_op_table(step))


def torch_op_table(step, steps: int = 5, rows: int = 30) -> str:
    """torch.profiler's CPU side of `steps` training steps, the GPU busy (launches never
    wait): PyTorch's own ops (the router's linear, casts, autograd nodes, allocations) by
    self CPU time a step, which the wall clocks around mokgen's functions see only as the
    time outside them."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    torch.cuda.synchronize()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    lines = ["| op | self CPU us a step | total CPU us a step | calls a step |",
             "|---|---|---|---|"]
    lines += [f"| {e.key[:60]} | {e.self_cpu_time_total / steps:.1f} "
              f"| {e.cpu_time_total / steps:.1f} | {e.count / steps:g} |" for e in ops[:rows]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
