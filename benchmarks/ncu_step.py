"""A few training steps of mokgen.MoE (one GPU, ep = 1, bf16, no shared expert): the program
ncu profiles (benchmarks/ncu_top.py reads the result), with plan overrides as KEY=VALUE:

    python3 benchmarks/ncu_step.py qwen3-30b-a3b 8192 dispatch=gather [--steps 4] [--prebuild]

--prebuild compiles the layer's kernels only (here, into $MOKGEN_CACHE; no GPU needed), so a
device call carries them. Which kernel launch ncu takes: mokgen_fwd and mokgen_bwd run once a
step (skip the first step's: its launches pay the first call's module loads and allocations).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import mokgen  # noqa: E402


def overrides(pairs: list[str]) -> dict:
    out = {}
    for p in pairs:
        key, _, value = p.partition("=")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape")
    ap.add_argument("tokens", type=int)
    ap.add_argument("overrides", nargs="*", help="plan overrides, KEY=VALUE")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prebuild", action="store_true")
    a = ap.parse_args(argv)
    s = mokgen.shapes.get(a.shape)
    shape = mokgen.MoEShape(s.num_experts, s.hidden, s.intermediate, s.topk, shared_experts=0)
    over = overrides(a.overrides)
    if a.prebuild:
        from mokgen.pytorch.api import build_plans
        from mokgen.compiler.tuned import tuned_plan
        bins = build_plans([tuned_plan(shape, 1, "bf16", a.tokens, **over)], jobs=os.cpu_count())
        print(f"prebuild: {len(bins)} kernels, {sum(not b.cached for b in bins)} built")
        return 0
    layer = mokgen.MoE(shape, tokens_per_rank=a.tokens, **over, device="cuda").to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(a.tokens, shape.hidden, device="cuda", generator=g).bfloat16()
    dy = torch.randn(a.tokens, shape.hidden, device="cuda", generator=g).bfloat16()
    for _ in range(a.steps):
        layer(x.detach().requires_grad_()).backward(dy)
    torch.cuda.synchronize()
    print(f"{a.shape} T {a.tokens} {over}: {a.steps} steps done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
