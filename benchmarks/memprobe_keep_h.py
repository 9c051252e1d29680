"""keep_h's memory against the default plan's (Qwen3-30B-A3B, T 8192, one GPU): L layers on
the same x, memory allocated before a step (base: workspace, weights), after the forwards
(what each call keeps) and at the step's peak (gradients of every parameter included), plus
the layer's memory() report. `python3 benchmarks/memprobe_keep_h.py`"""
import gc
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import mokgen  # noqa: E402

T, D, I, E, k = 8192, 2048, 768, 128, 8
shape = mokgen.MoEShape(E, D, I, k, shared_experts=0)
for over in ({}, {"keep_h": True}):
    for L in (1, 2):
        gc.collect()
        torch.cuda.empty_cache()
        x = torch.randn(T, D, device="cuda").bfloat16()
        dy = torch.randn_like(x)
        layers = [mokgen.MoE(shape, tokens_per_rank=T, device="cuda", **over) for _ in range(L)]
        def step(mark=None):
            xg = x.detach().requires_grad_()
            outs = [m(xg) for m in layers]
            if mark is not None:
                torch.cuda.synchronize()
                mark.append(torch.cuda.memory_allocated())
            torch.autograd.backward(outs, [dy] * L)
        for _ in range(2):
            for m in layers:
                m.zero_grad(set_to_none=True)
            step()
        for m in layers:
            m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        mark = []
        step(mark)
        torch.cuda.synchronize()
        params = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
        ws = layers[0].memory()
        mib = lambda v: f"{v / 2**20:.0f}"  # noqa: E731
        print(over, L, f"base {mib(base)} MiB, after fwd +{mib(mark[0] - base)}, "
              f"peak +{mib(torch.cuda.max_memory_allocated() - base)} (params {mib(params)}), "
              f"workspace {mib(ws['workspace'])}, saved/call {mib(ws['saved_per_call'])}",
              flush=True)
        del layers, x, dy
