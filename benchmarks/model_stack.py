"""How much memory does a model of MoE layers need to train, and how fast is its step? A stack
of N MoE layers (pre-norm residual blocks h + MoE(RMSNorm(h)), the router in each layer;
attention left out) trained one step at a time on one GPU, mokgen.MoE against the same stack
in plain PyTorch (softmax top-k, torch._grouped_mm, autograd), with and without activation
checkpointing, on the same weights (same seed and initialization order) and inputs.

Per configuration:
- held: bytes allocated after a step beyond the weights and their gradients (mokgen: its one
  shared workspace and what the layers keep for their backward), per layer;
- peak: the most allocated during a step beyond what was allocated before it;
- step: median time of a training step (forward + backward), CUDA events.
Steps accumulate into the gradients the first step made (micro-batches of one optimizer
step). `--dtype fp8` (or mxfp8) runs mokgen's layers in that precision against the same bf16
PyTorch stack; an fp8 layer's held bytes include its quantized weights (the forward's
layout: the steps' weights do not change; each backward makes and frees the transposed one).
`--keep-h 0` / `1` forces mokgen's keep_h off / on (default `d`: the plan's choice,
mokgen/compiler/passes/keep_h.py); `--fuse 1` builds mokgen's layers with
fuse_grad_accumulation (the kernel adds the expert gradients into .grad: no
expert-gradient-sized temporary, which autograd's accumulation allocates on both sides
otherwise). A configuration that does not fit
is recorded as out of memory; with --fit the most layers at which both fit (halving from N)
is measured as well.

    python benchmarks/model_stack.py [--shapes qwen3-30b-a3b,olmoe-1b-7b] [--layers 4,fit]
        [--tokens 8192] [--ckpt 0,1] [--fuse 0] [--keep-h d] [--dtype bf16] [--fit] [--out DIR]

Rows go into DIR/model_stack.json (rows per GPU kind, benchmarks/result_file.py); a table
is printed.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import mokgen  # noqa: E402
from mokgen.pytorch.api import max_layers, stack_memory  # noqa: E402

import result_file  # noqa: E402

# dtype: mokgen's precision, in the rows of fp8 / MXFP8 runs only (bf16 rows keep their key)
KEY = ("shape", "layers", "tokens", "checkpointing", "fused_grad_accumulation", "keep_h",
       "dtype")


class GroupedMoE(nn.Module):
    """The plain PyTorch MoE a user would write: softmax top-k router, tokens sorted by
    expert, torch._grouped_mm for gate/up and down, weighted scatter-add back; the
    parameters of mokgen.MoE (same names and layouts)."""

    def __init__(self, shape, device):
        super().__init__()
        E, D, I = shape.num_experts, shape.hidden, shape.intermediate
        self.shape = shape
        bf = dict(device=device, dtype=torch.bfloat16)
        # mokgen.MoE's parameters in its creation and initialization order: with one seed,
        # both stacks hold the same weights
        self.router = nn.Linear(D, E, bias=False, device=device)
        self.w1 = nn.Parameter(torch.empty(E, 2 * I, D, **bf))
        self.w2 = nn.Parameter(torch.empty(E, D, I, **bf))
        self.shared_w1 = self.shared_w2 = None
        if shape.shared_experts:
            S = shape.shared_dim
            self.shared_w1 = nn.Parameter(torch.empty(2 * S, D, **bf))
            self.shared_w2 = nn.Parameter(torch.empty(D, S, **bf))
        mokgen.MoE.reset_parameters(self)

    def forward(self, x):
        s, n = self.shape, x.shape[0]
        probs = torch.softmax(self.router(x.float()), dim=-1)
        w, e = probs.topk(s.topk, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        order = torch.argsort(e.flatten(), stable=True)
        token = order // s.topk
        offs = torch.cumsum(torch.bincount(e.flatten(), minlength=s.num_experts), 0).int()
        h = torch._grouped_mm(x[token], self.w1.transpose(1, 2), offs=offs)
        I = s.intermediate
        o = torch._grouped_mm(F.silu(h[:, :I]) * h[:, I:], self.w2.transpose(1, 2), offs=offs)
        o = o * w.flatten()[order, None].to(o.dtype)
        y = torch.zeros_like(x).index_add(0, token, o)
        if self.shared_w1 is not None:
            hs = x @ self.shared_w1.t()
            S = s.shared_dim
            y = y + (F.silu(hs[:, :S]) * hs[:, S:]) @ self.shared_w2.t()
        return y


class Block(nn.Module):
    """Pre-norm residual MoE block: h + moe(rmsnorm(h))."""

    def __init__(self, moe):
        super().__init__()
        self.norm = nn.RMSNorm(moe.shape.hidden, device=moe.w1.device, dtype=torch.bfloat16)
        self.moe = moe

    def forward(self, h):
        return h + self.moe(self.norm(h))


class Stack(nn.Module):
    """Blocks one after another, each under activation checkpointing (non-reentrant) when
    `ckpt`: its forward re-runs right before its backward."""

    def __init__(self, moes, ckpt: bool):
        super().__init__()
        self.blocks, self.ckpt = nn.ModuleList(Block(m) for m in moes), ckpt

    def forward(self, h):
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=False) if self.ckpt else b(h)
        return h


def build(impl, shape, layers, tokens, ckpt, fuse=False, keep_h=None, dtype="bf16"):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    if impl == "torch":
        moes = [GroupedMoE(shape, dev) for _ in range(layers)]
    else:
        moes = [mokgen.MoE(shape, tokens_per_rank=tokens, device=dev, dtype=dtype,
                           fuse_grad_accumulation=fuse,
                           **({} if keep_h is None else {"keep_h": keep_h}))
                for _ in range(layers)]
    return Stack(moes, ckpt)


def measure(impl, shape, layers, tokens, ckpt, iters, fuse=False, keep_h=None, dtype="bf16"):
    """-> dict of held/peak MB and step ms, or {"oom": True}. The steps accumulate into
    the gradients of the first (as micro-batches do): `fuse` (mokgen.MoE's
    fuse_grad_accumulation) adds the expert gradients in the kernel from the second on."""
    gc.collect()
    torch.cuda.empty_cache()
    model = x = dy = None
    try:
        model = build(impl, shape, layers, tokens, ckpt, fuse, keep_h, dtype)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        x = torch.randn(tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        inputs = 2 * x.numel() * x.element_size()

        def step():
            xg = x.detach().requires_grad_()
            model(xg).backward(dy)

        step()  # kernels, workspace, gradients allocated
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - 2 * params - inputs
        times, peaks = [], []
        for _ in range(iters):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
            peaks.append(torch.cuda.max_memory_allocated() - before)
        times.sort()
        out = {"held_mb_per_layer": held / layers / 2**20, "peak_mb": max(peaks) / 2**20,
               "step_ms": times[len(times) // 2]}
        if impl == "mokgen":
            m = model.blocks[0].moe.memory()
            out["workspace_mb"] = m["workspace"] / 2**20
            out["keep_h"] = model.blocks[0].moe.plan.keep_h
            rt = mokgen.pytorch.ops.kernels_of(model.blocks[0].moe._layer).compiled.runtime()
            out["replayed_per_step"] = rt.stats["replayed"] / (iters + 1)
            # the planner's prediction of the same bytes (held + peak beyond weights, grads)
            pred = stack_memory(model.blocks[0].moe.plan, layers, checkpointing=ckpt,
                                fused=fuse, extra_saved_per_layer=tokens * shape.hidden * 2)
            out["predicted_mb"] = (pred["total"] - pred["weights"] - pred["grads"]) / 2**20
            out["measured_mb"] = (held + max(peaks)) / 2**20
        return out
    except torch.OutOfMemoryError:
        return {"oom": True}
    finally:
        del model, x, dy
        gc.collect()
        torch.cuda.empty_cache()


def rows_of(name, shape, layers, tokens, ckpt, iters, fuses=(False,), keeps=(None,),
            dtype="bf16"):
    """One row per mokgen variant (`fuses` x `keeps`: fused accumulation, keep_h forced or
    None for the plan's own), the PyTorch stack measured once for them."""
    base = measure("torch", shape, layers, tokens, ckpt, iters)
    rows = []
    for fuse, keep_h in ((f, k) for f in fuses for k in keeps):
        res = {"torch": base, "mokgen": measure("mokgen", shape, layers, tokens, ckpt, iters,
                                                fuse, keep_h, dtype)}
        row = {"shape": name, "layers": layers, "tokens": tokens, "checkpointing": ckpt,
               "fused_grad_accumulation": fuse,
               "keep_h": res["mokgen"].get("keep_h", keep_h)}  # the plan's
        if dtype != "bf16":
            row["dtype"] = dtype
        for impl, r in res.items():
            row[f"{impl}_oom"] = bool(r.get("oom"))
            for k in ("held_mb_per_layer", "peak_mb", "step_ms"):
                row[f"{impl}_{k}"] = r.get(k)
        row["mokgen_workspace_mb"] = res["mokgen"].get("workspace_mb")
        for k in ("predicted_mb", "measured_mb"):
            row[f"mokgen_{k}"] = res["mokgen"].get(k)
        row["mokgen_replayed_per_step"] = res["mokgen"].get("replayed_per_step")
        rows.append(row)
    return rows


def rows_for(name, layers, tokens, ckpt, iters, fit, fuses=(False,), keeps=(None,),
             dtype="bf16"):
    """The rows at `layers`; with `fit`, where either side ran out of memory, also the rows at
    the most layers (halving) where both fit."""
    rows = rows_of(name, get_shape(name), layers, tokens, ckpt, iters, fuses, keeps, dtype)
    n = layers
    while fit and n > 1 and (rows[-1]["torch_oom"] or rows[-1]["mokgen_oom"]):
        n //= 2
        rows += rows_of(name, get_shape(name), n, tokens, ckpt, iters, fuses, keeps, dtype)
    return rows


def fitting_layers(name, tokens, ckpt, fuse=False, keep_h=None, dtype="bf16") -> int:
    """The most layers the planner predicts mokgen's stack trains in on this GPU."""
    shape = get_shape(name)
    plan = mokgen.plan(shape, ep=1, tokens_per_rank=tokens, dtype=dtype,
                       **({} if keep_h is None else {"keep_h": keep_h}))
    return max_layers(plan, checkpointing=ckpt, fused=fuse,
                      extra_saved_per_layer=tokens * shape.hidden * 2)


def get_shape(name):
    return mokgen.shapes.get(name)  # the public models' presets (mokgen/shapes.py)


def main(argv=None):
    p = argparse.ArgumentParser(prog="benchmarks/model_stack.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b,olmoe-1b-7b",
                   help="comma list of model presets (default: %(default)s)")
    p.add_argument("--layers", default="4,fit",
                   help="comma list of layer counts; 'fit': the most layers the planner "
                        "predicts mokgen trains in on this GPU (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens a step")
    p.add_argument("--iters", type=int, default=5, help="timed steps a configuration")
    p.add_argument("--ckpt", default="0,1", help="checkpointing off/on: 0, 1 or 0,1")
    p.add_argument("--fit", action="store_true", help="halve the layers until both fit")
    p.add_argument("--fuse", default="0", help="mokgen's fuse_grad_accumulation: 0, 1 or 0,1")
    p.add_argument("--keep-h", default="d",
                   help="mokgen's keep_h: d (the plan's), 0, 1, or a list such as 0,d")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp8", "mxfp8"),
                   help="mokgen's precision (the PyTorch stack runs bf16; default: "
                        "%(default)s)")
    p.add_argument("--out", default=result_file.RESULTS,
                   help="folder of model_stack.json (default: %(default)s)")
    a = p.parse_args(argv)
    rows = []
    for name in a.shapes.split(","):
        for layers_arg in a.layers.split(","):
            for ckpt in (bool(int(v)) for v in a.ckpt.split(",")):
                fuses = [bool(int(v)) for v in a.fuse.split(",")]
                keeps = [None if v == "d" else bool(int(v)) for v in a.keep_h.split(",")]
                layers = (fitting_layers(name, a.tokens, ckpt, fuses[0], keeps[0], a.dtype)
                          if layers_arg == "fit" else int(layers_arg))
                for row in rows_for(name, layers, a.tokens, ckpt, a.iters, a.fit, fuses, keeps,
                                    a.dtype):
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    fmt = lambda v, f="{:.0f}": "OOM" if v is None else f.format(v)  # noqa: E731
    print("| shape | layers | ckpt | fused acc. | keep_h | held MB/layer mokgen | torch "
          "| peak MB mokgen | torch | step ms mokgen | torch | x |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = (r["torch_step_ms"] / r["mokgen_step_ms"]
                 if r["torch_step_ms"] and r["mokgen_step_ms"] else None)
        shape = r["shape"] + (f" ({r['dtype']})" if r.get("dtype") else "")
        print(f"| {shape} | {r['layers']} | {int(r['checkpointing'])} "
              f"| {int(r['fused_grad_accumulation'])} "
              f"| {'-' if r['keep_h'] is None else int(r['keep_h'])} "
              f"| {fmt(r['mokgen_held_mb_per_layer'])} | {fmt(r['torch_held_mb_per_layer'])} "
              f"| {fmt(r['mokgen_peak_mb'])} | {fmt(r['torch_peak_mb'])} "
              f"| {fmt(r['mokgen_step_ms'], '{:.1f}')} | {fmt(r['torch_step_ms'], '{:.1f}')} "
              f"| {fmt(ratio, '{:.2f}')} |")
    print(f"wrote {result_file.write('model_stack', rows, KEY, out=a.out)}")


if __name__ == "__main__":
    main()
