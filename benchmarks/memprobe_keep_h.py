import gc, sys, torch, mokgen
sys.path.insert(0, "benchmarks")
T, D, I, E, k = 8192, 2048, 768, 128, 8
shape = mokgen.MoEShape(E, D, I, k, shared_experts=0)
for over in ({}, {"keep_h": True}):
    for L in (1, 2):
        gc.collect(); torch.cuda.empty_cache()
        x = torch.randn(T, D, device="cuda").bfloat16(); dy = torch.randn_like(x)
        layers = [mokgen.MoE(shape, tokens_per_rank=T, device="cuda", **over) for _ in range(L)]
        def step(mark=None):
            xg = x.detach().requires_grad_()
            outs = [m(xg) for m in layers]
            if mark is not None:
                torch.cuda.synchronize(); mark.append(torch.cuda.memory_allocated())
            torch.autograd.backward(outs, [dy] * L)
        for _ in range(2):
            for m in layers: m.zero_grad(set_to_none=True)
            step()
        for m in layers: m.zero_grad(set_to_none=True)
        torch.cuda.synchronize(); base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats(); mark = []
        step(mark); torch.cuda.synchronize()
        params = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
        ws = layers[0].memory()
        print(over, L, f"base {base/2**20:.0f} MiB, after fwd +{(mark[0]-base)/2**20:.0f}, "
              f"peak +{(torch.cuda.max_memory_allocated()-base)/2**20:.0f} (params {params/2**20:.0f}), "
              f"workspace {ws['workspace']/2**20:.0f}, saved/call {ws['saved_per_call']/2**20:.0f}", flush=True)
        del layers, x, dy
