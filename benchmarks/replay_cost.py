"""What a model pays for the shared ring: L layers of one shape share one workspace
(runtime/workspace.py's pool), so only the backward of the layer whose forward ran last finds
its activations in the ring; every other layer's backward replays its gate/up (re-pulls x,
recomputes h and a: moe_bwd.cuh `replayed`), unless the plan has keep_h (each call keeps
its own h; the backward pulls x). This times a training step of L independent
layers on the same x (outputs summed into one backward: autograd runs the layers' backwards
last layer first) against one layer, per layer, fresh gradients (zero_grad(set_to_none)).

    python3 benchmarks/replay_cost.py --out $OUT [--shapes qwen3-30b-a3b,...] [--layers 1,4]
        [--variant NAME+field=value] [--prebuild]

Prints per shape the per-layer step ms at each L, the ratio to L = 1, and the backward
calls that replayed (the runtimes' counts); writes OUT/replay_cost.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import mokgen  # noqa: E402
from mokgen.bench import results_commit, time_ms  # noqa: E402
from gather_ab import prebuild, selected, selection_args  # noqa: E402


def runtimes():
    from mokgen.runtime.moe import ForwardRuntime
    return [o for o in gc.get_objects() if isinstance(o, ForwardRuntime)]


def measure(D, I, E, k, T, L, iters, over):
    gc.collect()
    torch.cuda.empty_cache()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    shape = mokgen.MoEShape(E, D, I, k, shared_experts=0)
    layers = [mokgen.MoE(shape, tokens_per_rank=T, device="cuda", **over) for _ in range(L)]
    params = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())

    def fresh():
        for m in layers:
            m.zero_grad(set_to_none=True)

    def step():
        xg = x.detach().requires_grad_()
        outs = [m(xg) for m in layers]
        torch.autograd.backward(outs, [dy] * L)

    step()
    torch.cuda.synchronize()
    before = sum(r.stats["replayed"] for r in runtimes())
    calls = sum(r.stats["backward"] for r in runtimes())
    ms = time_ms(step, iters, warmup=3, setup=fresh)
    replayed = sum(r.stats["replayed"] for r in runtimes()) - before
    bwd_calls = sum(r.stats["backward"] for r in runtimes()) - calls
    fresh()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base - params) / 2**20  # its gradients out
    del layers
    return dict(ms_per_layer=ms / L, replayed_per_step=replayed / max(1, bwd_calls) * L,
                peak_mb=peak)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--layers", default="1,4")
    selection_args(ap, "pull,pull+keep_h=true",
                   "gather_ab.py's variants (pull: the default plan; +keep_h=true: each call "
                   "keeps its h, no backward replays)")
    a = ap.parse_args(argv)
    shapes, variants = selected(a)
    if a.prebuild:
        prebuild(shapes, variants)
        return 0
    rows = []
    Ls = [int(v) for v in a.layers.split(",")]
    for name, T, D, I, E, k in shapes:
        for vname, over in variants.items():
            r = dict(shape=name, T=T, variant=vname)
            for L in Ls + Ls[::-1]:  # mirrored: each L twice, medians of the two
                m = measure(D, I, E, k, T, L, a.iters, over)
                r.setdefault(L, []).append(m)
            for L in Ls:
                ms = sorted(x["ms_per_layer"] for x in r[L])
                r[f"L{L}_ms_per_layer"] = sum(ms) / len(ms)
                r[f"L{L}_replayed"] = r[L][0]["replayed_per_step"]
                r[f"L{L}_peak_mb"] = r[L][0]["peak_mb"]
                del r[L]
            base = r[f"L{Ls[0]}_ms_per_layer"]
            flops = 18 * T * k * D * I
            print(" | ".join([name, vname] + [
                f"L{L} {r[f'L{L}_ms_per_layer']:.3f} ms/layer "
                f"({flops / r[f'L{L}_ms_per_layer'] / 1e9:.0f} TFLOP/s, "
                f"x{r[f'L{L}_ms_per_layer'] / base:.3f}, replayed {r[f'L{L}_replayed']:.0f}, "
                f"peak {r[f'L{L}_peak_mb']:.0f} MB)" for L in Ls]), flush=True)
            rows.append(r)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "replay_cost.json"), "w") as f:
        json.dump(dict(commit=results_commit(), gpu=torch.cuda.get_device_name(), rows=rows),
                  f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
