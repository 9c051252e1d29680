"""Where a backward slice's event time goes beyond its megakernel (benchmarks/models.py reads
Mixtral-8x7B's backward at ~11.1 ms against a ~9.5 ms kernel): the slice timed as models.py
times it (its forward queued ahead, untimed), the GPU's time alone (queue_ahead), the host's
wall time of the forward and the backward calls while the GPU is busy, and one profiled
iteration's host-side calls longer than 50 us (CUDA runtime / driver calls included: a
synchronizing one shows up there).

    python benchmarks/bwd_gap.py [SHAPE] [EP] [TOKENS]"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mokgen  # noqa: E402
from mokgen.harness.bench import make_slice, time_ms  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "mixtral-8x7b"
ep = int(sys.argv[2]) if len(sys.argv) > 2 else 1
n = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
g = torch.Generator(device="cuda").manual_seed(0)
shape = mokgen.shapes.get(name)
xs, zs, w1, w2, sw1, sw2 = make_slice(shape, ep, n, g)
layer = mokgen.compile(shape, ep=ep, tokens_per_rank=n, virtual=True)
rt, bwd = layer.runtime(), layer.backward_runtime()
args = (xs, zs, [w1] * ep, [w2] * ep, sw1, sw2)
dys = [torch.randn(x.shape, device="cuda", generator=g).bfloat16() for x in xs]
layer(x=xs, router_logits=zs, w1=[w1] * ep, w2=[w2] * ep, shared_w1=sw1, shared_w2=sw2)
fwd = lambda: rt.forward_rank(0, *args, save=True)  # noqa: E731
ours = lambda: bwd.backward_rank(0, dys, xs, [w1] * ep, [w2] * ep, sw1, sw2)  # noqa: E731
fwd()
ours()
print(f"{name} ep {ep} N {n}: backward as models.py times it {time_ms(ours, 20, setup=fwd):.3f} "
      f"ms, the GPU's alone {time_ms(ours, 20, setup=fwd, queue_ahead=True):.3f} ms, "
      f"forward {time_ms(fwd, 20):.3f} ms")
walls = {"fwd": [], "bwd": []}
for _ in range(10):
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # the GPU busy: launches never wait for it
    for k, f in (("fwd", fwd), ("bwd", ours)):
        t = time.perf_counter()
        f()
        walls[k].append(1e3 * (time.perf_counter() - t))
torch.cuda.synchronize()
print("host wall ms (GPU busy): " + ", ".join(f"{k} {statistics.median(v):.3f}"
                                              for k, v in walls.items()))
from torch.profiler import ProfilerActivity, profile  # noqa: E402
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    fwd()
    ours()
    torch.cuda.synchronize()
evs = [e for e in prof.events() if e.device_type.name == "CPU"]
evs.sort(key=lambda e: e.time_range.start)
base = evs[0].time_range.start if evs else 0
print("host calls >= 50 us in the profiled forward + backward (start us, duration us):")
for e in evs:
    d = e.time_range.end - e.time_range.start
    if d >= 50:
        print(f"  {e.time_range.start - base:9.0f} {d:8.0f}  {e.name[:70]}")
gpu = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
             key=lambda e: e.time_range.start)
print("GPU work (start us, duration us): " + ", ".join(
    f"{e.name[:28]} @{e.time_range.start - base:.0f}: {e.time_range.end - e.time_range.start:.0f}"
    for e in gpu))
