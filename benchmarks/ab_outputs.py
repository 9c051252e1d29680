"""Two trees' layers, output for output: does a change leave the results bitwise as they were?
Run from each tree (it imports the mokgen of the tree it sits in) with the same arguments; each
run writes the forward's y and the backward's dx / dW1 / dW2 / shared dW of every case to a
file, on fresh random inputs from a fixed seed (the same in both trees); then compare:

    python benchmarks/ab_outputs.py dump FILE [MODEL:EP:TOKENS[:gather] ...]
    python benchmarks/ab_outputs.py compare FILE_A FILE_B
    python benchmarks/ab_outputs.py prebuild [CASE ...]   (here, no GPU: the cases' kernels
                                                           into $MOKGEN_CACHE)

compare prints, per case and tensor, whether they are equal (torch.equal: -0 equals +0) and
the largest difference, and exits 1 if any differ or a result is not finite. The default
cases have experts whose last row tile holds at most 64 rows (random routing), a shared
expert, edge tiles (I 1408) and a token count that ends in a short row tile."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mokgen  # noqa: E402
from mokgen.harness.bench import make_slice  # noqa: E402

CASES = ("qwen3-30b-a3b:1:4096", "mixtral-8x7b:1:2048", "deepseek-v2-lite:1:2088",
         "qwen3-30b-a3b:1:1000:gather")


def parse(spec: str):
    name, ep, n, *opt = spec.split(":")
    over = dict(dispatch="gather") if "gather" in opt else {}
    return mokgen.shapes.get(name), int(ep), int(n), over


def run_case(spec: str) -> dict:
    shape, ep, n, over = parse(spec)
    g = torch.Generator(device="cuda").manual_seed(1234)
    xs, zs, w1, w2, sw1, sw2 = make_slice(shape, ep, n, g)
    layer = mokgen.compile(shape, ep=ep, tokens_per_rank=n, virtual=True, **over)
    rt, bwd = layer.runtime(), layer.backward_runtime()
    w1s, w2s = [w1] * ep, [w2] * ep
    layer(x=xs, router_logits=zs, w1=w1s, w2=w2s, shared_w1=sw1, shared_w2=sw2)
    dys = [torch.randn(x.shape, device="cuda", generator=g).bfloat16() for x in xs]
    y = rt.forward_rank(0, xs, zs, w1s, w2s, sw1, sw2, save=True).clone()
    grads = bwd.backward_rank(0, dys, xs, w1s, w2s, sw1, sw2)
    out = {"y": y}
    for k, v in zip(("dx", "dw1", "dw2", "dsw1", "dsw2"), grads):
        if v is not None:
            out[k] = v.clone()
    torch.cuda.synchronize()
    return {k: v.cpu() for k, v in out.items()}


def main(argv) -> int:
    if argv[:1] == ["prebuild"]:
        from mokgen.pytorch.api import build_plans
        from mokgen.compiler.tuned import tuned_plan
        for spec in argv[1:] or CASES:
            shape, ep, n, over = parse(spec)
            plan = tuned_plan(shape, ep, "bf16", n, **over)
            build_plans([plan])
            print(spec, "built", flush=True)
        return 0
    if argv[:1] == ["dump"] and len(argv) >= 2:
        res = {}
        for spec in argv[2:] or CASES:
            res[spec] = run_case(spec)
            print(spec, {k: tuple(v.shape) for k, v in res[spec].items()}, flush=True)
        torch.save(res, argv[1])
        return 0
    if argv[:1] == ["compare"] and len(argv) == 3:
        a, b = torch.load(argv[1]), torch.load(argv[2])
        bad = 0
        for spec in a:
            for k, va in a[spec].items():
                vb = b[spec][k]
                eq = torch.equal(va, vb)
                fin = bool(torch.isfinite(va.float()).all() and torch.isfinite(vb.float()).all())
                diff = (va.float() - vb.float()).abs().max().item()
                bad += (not eq) or (not fin)
                print(f"{spec} {k}: {'equal' if eq else 'DIFFERENT'}, finite {fin}, "
                      f"max |a - b| {diff:.3g}, |a| max {va.float().abs().max().item():.3g}")
        print("all equal" if not bad else f"{bad} tensors differ or are not finite")
        return 1 if bad else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
