"""Where a benchmarked call's event time goes beyond its kernels (issue #16: Mixtral-8x22B's
traced forward and backward read 8.7 / 18.0 ms by events against 7.0 / 15.0 ms of megakernel).
One slice as benchmarks/models.py times it (mokgen.harness.bench: forward_rank, backward_rank after
an untimed forward; autograd through torch._grouped_mm), each call timed three ways: CUDA
events with the GPU idle before it (what models.py reports), events with the launches queued
behind a GPU sleep (the GPU's time alone), and the sum of its kernels' durations from
torch.profiler over the same loop, their span, the host's wall time of the call (the profiler
inflates it), and the largest gap between two kernels.

    python3 benchmarks/gaps.py mixtral-8x22b 1 4096 [--iters 10] [--prebuild]"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import mokgen  # noqa: E402
from mokgen.harness.bench import (TrainingSteps, kernel_times, make_slice, short_kernel_name,  # noqa: E402
                          time_ms)


def profiled(run, setup, iters):
    """Per iteration of `iters` (setup untimed, as time_ms): the kernels' summed duration
    (ms), their span from the first start to the last end (ms), the host's wall time of
    run() (ms, under the profiler: inflated) and the largest gap between one kernel's end
    and the next's start (us), medians (the kernels: mokgen.harness.bench.kernel_times)."""
    spans = []
    for _ in range(iters):
        wall = []

        def timed():
            t0 = time.perf_counter()
            run()
            wall.append((time.perf_counter() - t0) * 1e3)
        evs = kernel_times(setup or (lambda: None), timed)  # (name, start us, duration us)
        gaps = [(b[1] - a[1] - a[2], f"{short_kernel_name(a[0])} -> {short_kernel_name(b[0])}")
                for a, b in zip(evs, evs[1:])]
        spans.append((sum(d for _, _, d in evs) / 1e3, (evs[-1][1] + evs[-1][2]) / 1e3,
                      wall[0], max(gaps, default=(0.0, ""))))
    return (*(statistics.median(s[i] for s in spans) for i in range(3)),
            sorted(s[3] for s in spans)[len(spans) // 2])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape")
    ap.add_argument("ep", type=int)
    ap.add_argument("n", type=int)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--prebuild", action="store_true")
    a = ap.parse_args(argv)
    shape = mokgen.shapes.get(a.shape)
    if a.prebuild:
        from mokgen.pytorch.api import build_plans
        from mokgen.compiler.tuned import tuned_plan
        bins = build_plans([tuned_plan(shape, a.ep, "bf16", a.n)], jobs=os.cpu_count())
        print(f"prebuild: {len(bins)} kernels, {sum(not b.cached for b in bins)} built")
        return 0
    g = torch.Generator(device="cuda").manual_seed(0)
    xs, zs, w1, w2, sw1, sw2 = make_slice(shape, a.ep, a.n, g)
    layer = mokgen.compile(shape, ep=a.ep, tokens_per_rank=a.n, virtual=True)
    args = (xs, zs, [w1] * a.ep, [w2] * a.ep, sw1, sw2)
    st = TrainingSteps(layer, shape, args, g)
    rt = layer.runtime()
    fwd = lambda: rt.forward_rank(0, *args)  # noqa: E731
    calls = {"mokgen fwd": (fwd, None), "mokgen bwd": (st.bwd, st.fwd),
             "grouped fwd": (lambda: st.tg.grouped(st.routes, st.weights), None),
             "grouped bwd": (st.back, st.setup)}
    rows = []
    for name, (run, setup) in calls.items():
        idle = time_ms(run, a.iters, setup=setup)
        queued = time_ms(run, a.iters, setup=setup, queue_ahead=True)
        kern, span, wall, (gap_us, where) = profiled(run, setup, 3)
        rows.append(dict(call=name, event_ms=idle, queued_ms=queued, kernels_ms=kern,
                         span_ms=span, host_ms=wall, max_gap_us=gap_us, max_gap_at=where))
        print(json.dumps(rows[-1]), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"gaps_{a.shape}_ep{a.ep}_n{a.n}.json"), "w") as f:
        json.dump(dict(commit=os.environ.get("MOKGEN_COMMIT"), gpu=torch.cuda.get_device_name(),
                       shape=a.shape, ep=a.ep, n=a.n, rows=rows), f, indent=1)
    print("| call | event ms (GPU idle before) | event ms (queued ahead) | kernels ms | "
          "kernels' span ms | host ms | largest gap us (where) |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['call']} | {r['event_ms']:.3f} | {r['queued_ms']:.3f} | "
              f"{r['kernels_ms']:.3f} | {r['span_ms']:.3f} | {r['host_ms']:.3f} | "
              f"{r['max_gap_us']:.0f} ({r['max_gap_at']}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
