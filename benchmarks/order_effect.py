"""Why a layer's backward slows after another model's layers ran in the same process (seen:
Mixtral-8x22B's ep 8 backward 42 ms after DeepSeek-V3's layers, 17 ms otherwise; NOTES.md).
Runs bench_one for each model in order, then, for the last one, the backward slice under
torch.profiler (its kernels by device time) with what could differ: rank 0's routed rows,
whether the ring still holds the forward, memory in use, live workspaces.

    python benchmarks/order_effect.py deepseek-v3,mixtral-8x22b [--ep 8] [--tokens 4096]"""
import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import mokgen  # noqa: E402
from mokgen.harness.bench import bench_one, make_slice  # noqa: E402
from mokgen.runtime.workspace import live_workspaces  # noqa: E402


def profile_backward(name: str, ep: int, n: int, g) -> None:
    shape = mokgen.shapes.get(name)
    xs, zs, w1, w2, sw1, sw2 = make_slice(shape, ep, n, g)
    layer = mokgen.compile(shape, ep=ep, tokens_per_rank=n, virtual=True)
    rt, bwd = layer.runtime(), layer.backward_runtime()
    args = (xs, zs, [w1] * ep, [w2] * ep, sw1, sw2)
    layer(x=xs, router_logits=zs, w1=[w1] * ep, w2=[w2] * ep, shared_w1=sw1, shared_w2=sw2)
    dys = [torch.randn(x.shape, device="cuda", generator=g).bfloat16() for x in xs]

    def steps():  # rank 0's forward (kept for the backward) and backward, three times
        for _ in range(3):
            rt.forward_rank(0, *args, save=True)
            bwd.backward_rank(0, dys, xs, [w1] * ep, [w2] * ep, sw1, sw2)
        torch.cuda.synchronize()

    steps()
    state = dict(model=name, rows_rank0=int(rt.ranks[0].meta[0].item()),
                 saved=bool(rt.saved), allocated_gb=torch.cuda.memory_allocated() / 2**30,
                 live_workspaces=live_workspaces(), plan=str(layer.plan.key()))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        steps()
    print(json.dumps(state), flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=40))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    names = a.models.split(",")
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    for name in names:
        before = torch.cuda.memory_stats()
        r = bench_one(name, a.ep, a.tokens, 10, g, backward=True, naive=False)
        after = torch.cuda.memory_stats()
        # the kernel alone ran 17 ms under the profiler where bench timed 42: does the caching
        # allocator free and re-allocate (a device sync in the timed region) on every call?
        churn = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
        print(json.dumps(dict(model=name, fwd_ms=r["mokgen_ms"], bwd_ms=r["backward"]["mokgen_ms"],
                              reserved_gb=torch.cuda.memory_reserved() / 2**30, **churn)),
              flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    profile_backward(names[-1], a.ep, a.tokens, g)


if __name__ == "__main__":
    main()
