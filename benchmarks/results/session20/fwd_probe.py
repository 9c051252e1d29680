import statistics, sys, time, torch, mokgen
tag = sys.argv[1]
for name, (E, D, I, k) in {"qwen3-30b": (128, 2048, 768, 8), "olmoe": (64, 2048, 1024, 8)}.items():
    m = mokgen.MoE(mokgen.MoEShape(E, D, I, k, shared_experts=0), tokens_per_rank=8192,
                   dispatch="pull", reverse_combine="pull").to("cuda", torch.bfloat16)
    x = torch.randn(8192, D, device="cuda").bfloat16()
    with torch.no_grad():
        for _ in range(5):
            m(x)
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(40)]
        for a, b in ev:
            a.record(); m(x); b.record()
        torch.cuda.synchronize()
        b2b = statistics.median(a.elapsed_time(b) for a, b in ev)
        idle = []
        for a, b in ev[:20]:
            time.sleep(0.01); a.record(); m(x); b.record(); torch.cuda.synchronize()
            idle.append(a.elapsed_time(b))
    print(f"{tag} {name}: fwd back-to-back {b2b:.3f} ms, after idle {statistics.median(idle):.3f} ms", flush=True)
    del m
