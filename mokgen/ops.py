"""The layer call as torch.library custom ops, so torch.compile captures it whole.

Two entry points, each with its backward op:
- `mokgen::moe_forward(x, router_logits, w1, w2, shared_w1?, shared_w2?, layer)`: routing
  by mokgen (softmax top-k, renormalized; design.md);
- `mokgen::moe_forward_routed(x, experts, weights, w1, w2, shared_w1?, shared_w2?, layer)`:
  routes chosen by the caller (a model's own router: sigmoid scores, groups, scaling...);
  the gradient flows back into `weights`.
`layer` indexes the registry of compiled layers (an int: ops take no Python objects).
- CUDA: the compiled megakernels of that layer (this process's rank).
- CPU, or a layer built with backend="reference": the reference (one rank holding every
  expert), so models run and test without a GPU and can be compared with the kernels.
- fake: empty tensors of the right shapes, for tracing.
The backward ops run the reference's explicit backward (exact, slow) until the backward
megakernel lands; they need every expert local (ep == 1).
"""
from __future__ import annotations

import torch

from . import reference

_LAYERS: list = []  # index -> (compiled callable or None, topk, ep)


def register(compiled, topk: int, ep: int) -> int:
    _LAYERS.append((compiled, topk, ep))
    return len(_LAYERS) - 1


def _f32(tensors):
    return [None if t is None else t.float() for t in tensors]


def _local_only(layer: int) -> int:
    _, topk, ep = _LAYERS[layer]
    if ep != 1:
        raise NotImplementedError("mokgen: this path holds every expert on one rank (ep == 1); "
                                  f"got ep={ep} (the backward megakernel is not built yet)")
    return topk


# ---------------------------------------------------------------- routing by mokgen
@torch.library.custom_op("mokgen::moe_forward", mutates_args=())
def moe_forward(x: torch.Tensor, router_logits: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor, shared_w1: torch.Tensor | None,
                shared_w2: torch.Tensor | None, layer: int) -> torch.Tensor:
    compiled = _LAYERS[layer][0]
    if x.is_cuda and compiled is not None:
        return compiled(x, router_logits, w1, w2, shared_w1, shared_w2)
    topk = _local_only(layer)
    f = _f32((x, router_logits, w1, w2, shared_w1, shared_w2))
    return reference.moe_forward(*f, topk).to(x.dtype)


@moe_forward.register_fake
def _(x, router_logits, w1, w2, shared_w1, shared_w2, layer):
    return torch.empty_like(x)


@torch.library.custom_op("mokgen::moe_backward", mutates_args=())
def moe_backward(dy: torch.Tensor, x: torch.Tensor, router_logits: torch.Tensor,
                 w1: torch.Tensor, w2: torch.Tensor, shared_w1: torch.Tensor | None,
                 shared_w2: torch.Tensor | None, layer: int) -> list[torch.Tensor]:
    """Gradients of (x, router_logits, w1, w2, shared_w1, shared_w2) from the reference's
    explicit backward (an op runs below autograd, so no autograd inside); empty tensors stand
    for the shared ones when there is no shared expert. An op of its own, so tracing sees
    its shapes (fake) instead of the reference's data-dependent routing."""
    like = (x, router_logits, w1, w2, shared_w1, shared_w2)
    grads = reference.moe_backward(*_f32(like), _local_only(layer), dy.float())
    return _cast(grads, like)


@moe_backward.register_fake
def _(dy, x, router_logits, w1, w2, shared_w1, shared_w2, layer):
    return _fake_grads((x, router_logits, w1, w2, shared_w1, shared_w2))


# ---------------------------------------------------------------- routes from the caller
@torch.library.custom_op("mokgen::moe_forward_routed", mutates_args=())
def moe_forward_routed(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                       w1: torch.Tensor, w2: torch.Tensor, shared_w1: torch.Tensor | None,
                       shared_w2: torch.Tensor | None, layer: int) -> torch.Tensor:
    compiled = _LAYERS[layer][0]
    if x.is_cuda and compiled is not None:
        return compiled(x, None, w1, w2, shared_w1, shared_w2, routes=(experts, weights))
    _local_only(layer)
    f = _f32((x, w1, w2, shared_w1, shared_w2))
    return reference.moe_forward_routed(f[0], experts, weights.float(), *f[1:]).to(x.dtype)


@moe_forward_routed.register_fake
def _(x, experts, weights, w1, w2, shared_w1, shared_w2, layer):
    return torch.empty_like(x)


@torch.library.custom_op("mokgen::moe_backward_routed", mutates_args=())
def moe_backward_routed(dy: torch.Tensor, x: torch.Tensor, experts: torch.Tensor,
                        weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                        shared_w1: torch.Tensor | None, shared_w2: torch.Tensor | None,
                        layer: int) -> list[torch.Tensor]:
    """Gradients of (x, weights, w1, w2, shared_w1, shared_w2); see moe_backward."""
    _local_only(layer)
    f = _f32((x, w1, w2, shared_w1, shared_w2))
    grads = reference.moe_backward_routed(f[0], experts, weights.float(), *f[1:], dy.float())
    return _cast(grads, (x, weights, w1, w2, shared_w1, shared_w2))


@moe_backward_routed.register_fake
def _(dy, x, experts, weights, w1, w2, shared_w1, shared_w2, layer):
    return _fake_grads((x, weights, w1, w2, shared_w1, shared_w2))


# ---------------------------------------------------------------- autograd wiring
def _cast(grads, like) -> list:
    """Gradients in their inputs' dtypes; an empty tensor for an absent input."""
    return [like[0].new_empty(0) if g is None else g.to(t.dtype) for g, t in zip(grads, like)]


def _fake_grads(like) -> list:
    return [like[0].new_empty(0) if t is None else torch.empty_like(t) for t in like]


def _grads_out(g, has_shared: bool) -> list:
    """The op's 6 gradients with empty placeholders turned back into None."""
    return list(g[:4]) + ([g[4], g[5]] if has_shared else [None, None])


def _setup(ctx, inputs, output):
    tensors = inputs[:-1]
    ctx.has_shared = tensors[-2] is not None
    ctx.save_for_backward(*[t for t in tensors if t is not None])
    ctx.layer = inputs[-1]


def _backward(ctx, dy):
    saved = list(ctx.saved_tensors)
    shared = saved[4:6] if ctx.has_shared else [None, None]
    return (*_grads_out(moe_backward(dy, *saved[:4], *shared, ctx.layer), ctx.has_shared), None)


def _backward_routed(ctx, dy):
    saved = list(ctx.saved_tensors)  # x, experts, weights, w1, w2[, shared_w1, shared_w2]
    shared = saved[5:7] if ctx.has_shared else [None, None]
    g = moe_backward_routed(dy, *saved[:5], *shared, ctx.layer)
    dx, dweights, dw1, dw2, dsw1, dsw2 = _grads_out(g, ctx.has_shared)
    return dx, None, dweights, dw1, dw2, dsw1, dsw2, None


moe_forward.register_autograd(_backward, setup_context=_setup)
moe_forward_routed.register_autograd(_backward_routed, setup_context=_setup)
