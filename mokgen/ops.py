"""The layer call as a torch.library custom op, so torch.compile captures it whole.

`mokgen::moe_forward(x, router_logits, w1, w2, shared_w1?, shared_w2?, layer) -> y` where
`layer` indexes the registry of compiled layers (an int: ops take no Python objects).
- CUDA: the compiled megakernels of that layer (this process's rank).
- CPU, or a layer built with backend="reference": the reference (one rank holding every
  expert), so models run and test without a GPU and can be compared with the kernels.
- fake: an empty tensor like x (shapes only), for tracing.
Autograd: `mokgen::moe_backward` runs the reference's explicit backward (exact, slow) until
the backward megakernel lands; it needs every expert local (ep == 1).
"""
from __future__ import annotations

import torch

from . import reference

_LAYERS: list = []  # index -> (CompiledMoE or None, topk, ep)


def register(compiled, topk: int, ep: int) -> int:
    _LAYERS.append((compiled, topk, ep))
    return len(_LAYERS) - 1


def _reference(x, logits, w1, w2, sw1, sw2, topk):
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    return reference.moe_forward(f32(x), logits.float(), f32(w1), f32(w2), f32(sw1), f32(sw2),
                                 topk).to(x.dtype)


@torch.library.custom_op("mokgen::moe_forward", mutates_args=())
def moe_forward(x: torch.Tensor, router_logits: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor, shared_w1: torch.Tensor | None,
                shared_w2: torch.Tensor | None, layer: int) -> torch.Tensor:
    compiled, topk, ep = _LAYERS[layer]
    if x.is_cuda and compiled is not None:
        return compiled(x, router_logits, w1, w2, shared_w1, shared_w2)
    if ep != 1:
        raise ValueError(f"the CPU path holds every expert on one rank: ep must be 1, got {ep}")
    return _reference(x, router_logits, w1, w2, shared_w1, shared_w2, topk)


@moe_forward.register_fake
def _(x, router_logits, w1, w2, shared_w1, shared_w2, layer):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*[t for t in inputs[:6] if t is not None])
    ctx.has_shared = inputs[4] is not None
    ctx.layer = inputs[6]


@torch.library.custom_op("mokgen::moe_backward", mutates_args=())
def moe_backward(dy: torch.Tensor, x: torch.Tensor, router_logits: torch.Tensor,
                 w1: torch.Tensor, w2: torch.Tensor, shared_w1: torch.Tensor | None,
                 shared_w2: torch.Tensor | None, layer: int) -> list[torch.Tensor]:
    """Gradients of (x, router_logits, w1, w2, shared_w1, shared_w2) from the reference's
    explicit backward (an op runs below autograd, so no autograd inside); empty tensors stand
    for the shared ones when there is no shared expert. An op of its own, so tracing sees
    its shapes (fake) instead of the reference's data-dependent routing."""
    _, topk, ep = _LAYERS[layer]
    if ep != 1:
        raise NotImplementedError("mokgen: the backward of an expert-parallel layer (ep > 1) "
                                  "needs the backward megakernel, not built yet")
    f32 = [None if t is None else t.float() for t in (x, router_logits, w1, w2, shared_w1,
                                                        shared_w2)]
    grads = reference.moe_backward(*f32, topk, dy.float())
    like = (x, router_logits, w1, w2, shared_w1, shared_w2)
    return [x.new_empty(0) if g is None else g.to(t.dtype) for g, t in zip(grads, like)]


@moe_backward.register_fake
def _(dy, x, router_logits, w1, w2, shared_w1, shared_w2, layer):
    like = [x, router_logits, w1, w2, shared_w1, shared_w2]
    return [x.new_empty(0) if t is None else torch.empty_like(t) for t in like]


def _backward(ctx, dy):
    saved = list(ctx.saved_tensors)
    shared = (saved[4], saved[5]) if ctx.has_shared else (None, None)
    g = moe_backward(dy, *saved[:4], *shared, ctx.layer)
    return g[0], g[1], g[2], g[3], (g[4] if ctx.has_shared else None), \
        (g[5] if ctx.has_shared else None), None


moe_forward.register_autograd(_backward, setup_context=_setup)
