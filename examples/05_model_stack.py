"""A model, not a layer: N pre-norm residual MoE blocks of one shape share one mokgen
workspace, so the memory beyond weights and gradients is the workspace once plus what each
layer keeps for its backward (its input, router logits, routes and, without checkpointing,
its h).

Two ways to train it, same gradients bit for bit:
- plain: each layer call keeps its gate/up pre-activations h for its backward (keep_h, the
  default at one rank in bf16), so no backward replays its gate/up GEMMs;
- checkpointed (`--ckpt`): torch.utils.checkpoint re-runs each block's forward right before
  its backward, so the ring holds it (the backward replays nothing) and no h is held from
  forward to backward.
`--micro M` accumulates the gradients of M micro-batches (one optimizer step): the layers add
their expert gradients into .grad inside the backward kernel (fuse_grad_accumulation, the
default in one process): no gradient-sized temporary from the second micro-batch on;
`--no-fuse` leaves the adding to autograd.

    python examples/05_model_stack.py --layers 48 --tokens 8192 [--ckpt] [--micro 4 [--no-fuse]]

Without a GPU it prints the plan's memory report only.
"""
import argparse

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import mokgen
from mokgen.pytorch.api import format_memory, memory_report



class Block(nn.Module):
    def __init__(self, shape, tokens, fuse):
        super().__init__()
        self.norm = nn.RMSNorm(shape.hidden, dtype=torch.bfloat16)
        self.moe = mokgen.MoE(shape, tokens_per_rank=tokens, fuse_grad_accumulation=fuse)

    def forward(self, h):
        return h + self.moe(self.norm(h))


class Model(nn.Module):
    def __init__(self, shape, layers, tokens, ckpt, fuse):
        super().__init__()
        self.blocks = nn.ModuleList(Block(shape, tokens, fuse) for _ in range(layers))
        self.ckpt = ckpt

    def forward(self, h):
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=False) if self.ckpt else b(h)
        return h


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--ckpt", action="store_true")
    p.add_argument("--micro", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--no-fuse", action="store_true", help="fuse_grad_accumulation=False")
    p.add_argument("--shape", default="qwen3-30b-a3b", help="a preset of mokgen.shapes")
    a = p.parse_args()
    shape = mokgen.shapes.get(a.shape)
    print(format_memory(memory_report(mokgen.plan(shape, ep=1, tokens_per_rank=a.tokens))))
    if not torch.cuda.is_available():
        return
    model = Model(shape, a.layers, a.tokens, a.ckpt, False if a.no_fuse else None).cuda()
    for _ in range(a.micro):  # the gradients of every micro-batch add up in .grad
        x = torch.randn(a.tokens, shape.hidden, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    m = model.blocks[0].moe.memory()
    print(f"{a.layers} layers, checkpointing {'on' if a.ckpt else 'off'}, {a.micro} "
          f"micro-batches{' (autograd adds the gradients)' if a.no_fuse else ''}: workspace "
          f"{m['workspace'] / 2**20:,.0f} MiB shared by {m['layers_sharing']} layers; "
          f"{torch.cuda.max_memory_allocated() / 2**30:,.1f} GiB peak in all")


if __name__ == "__main__":
    main()
