"""Where a training step of mokgen.MoE goes, beyond its two kernels (issue #17): the layer as a
user builds it (router, autograd, gradient accumulation into .grad), one GPU, ep = 1.
CUDA time per kernel over a few steps (torch.profiler), and the step's pieces timed apart:
forward without autograd, forward saving for the backward, the backward alone, the step.

    python benchmarks/profile_step.py [--shape qwen3-30b-a3b] [--tokens 8192] [--fuse]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mokgen  # noqa: E402
from mokgen.harness.bench import time_ms  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--fuse", action="store_true", help="fuse_grad_accumulation=True")
    ap.add_argument("--no-shared", action="store_true", help="drop the shared expert")
    a = ap.parse_args(argv)
    shape = mokgen.shapes.get(a.shape)
    if a.no_shared:
        shape = mokgen.MoEShape(shape.num_experts, shape.hidden, shape.intermediate, shape.topk,
                                shared_experts=0, name=shape.name)
    # in bf16 as a user's model would be (router included), as benchmarks/peers_sonicmoe.py
    layer = mokgen.MoE(shape, tokens_per_rank=a.tokens,
                       fuse_grad_accumulation=a.fuse, device="cuda").to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(a.tokens, shape.hidden, device="cuda", generator=g).bfloat16()
    dy = torch.randn_like(x)
    xg = x.detach().requires_grad_()
    saved = {}

    def fwd_nograd():
        with torch.no_grad():
            layer(x)

    def fwd_save():
        saved["y"] = layer(xg)

    def bwd():
        saved.pop("y").backward(dy)

    def step():
        layer(xg).backward(dy)

    step()  # .grad exists from here on, as in training
    times = dict(fwd_nograd=time_ms(fwd_nograd, a.iters, warmup=3),
                 step=time_ms(step, a.iters, warmup=3),
                 bwd=time_ms(bwd, a.iters, warmup=1, setup=fwd_save))
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                      max_name_column_width=60)
    print(table)
    flops = 6 * a.tokens * shape.topk * shape.hidden * shape.intermediate
    out = dict(shape=a.shape, tokens=a.tokens, fuse=a.fuse,
               **{k: round(v, 3) for k, v in times.items()},
               step_tflops=round(3 * flops / times["step"] / 1e9, 1))
    print(json.dumps(out))
    od = os.environ.get("OUT")
    if od:
        with open(os.path.join(od, f"profile_step_{a.shape}{'_fused' if a.fuse else ''}.txt"), "w") as f:
            f.write(table + "\n" + json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
