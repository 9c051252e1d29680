"""The layer call as torch.library custom ops, so torch.compile captures it whole.

Two entry points, each with its backward op:
- `mokgen::moe_forward(x, router_logits, w1, w2, shared_w1?, shared_w2?, layer)`: routing
  by mokgen (softmax top-k, renormalized; docs/design.md);
- `mokgen::moe_forward_routed(x, experts, weights, w1, w2, shared_w1?, shared_w2?, layer)`:
  routes chosen by the caller (a model's own router: sigmoid scores, groups, scaling...);
  the gradient flows back into `weights`.
`layer` indexes the registry of compiled layers (an int: ops take no Python objects).
- CUDA: the compiled megakernels of that layer (this process's rank).
- CPU, or a layer built with backend="reference": the reference (one rank holding every
  expert), so models run and test without a GPU and can be compared with the kernels.
- fake: empty tensors of the right shapes, for tracing.
The backward ops run the backward megakernel on CUDA, and the reference's explicit backward
elsewhere (which needs every expert local, ep == 1). `moe` / `moe_routed` are what modules
call: a plain eager call runs the forward op's body and its backward wiring under an
autograd.Function, without the dispatcher (end of this file); anything else goes through
the ops. A layer registered with an `owner`
(mokgen.MoE's fuse_grad_accumulation, on by default in one process) calls the *_into
backward ops instead on CUDA, in eager mode, once the owner's experts have a .grad: they add
into it (their mutated arguments) and return no expert weight gradients for autograd to add.
"""
from __future__ import annotations

import itertools

import torch

from mokgen import reference

# handle -> (compiled callable or None, topk, ep, fp8 format or None, owner or None); handles
# are never reused, so a stale one fails loudly instead of reaching another layer
_LAYERS: dict = {}
_NEXT = itertools.count()


def register(compiled, topk: int, ep: int, fp8: str | None = None, owner=None) -> int:
    """fp8: the layer's format ("fp8" | "mxfp8"), so the reference path quantizes the
    routed experts' operands as the kernels do; owner: a weak reference to the module whose
    w1 / w2 .grad the backward adds into (fused gradient accumulation: module docstring),
    or None. Pair with `unregister` (the modules do it when they are collected): the entry
    holds the layer's kernels and, through them, its share of the workspace."""
    handle = next(_NEXT)
    _LAYERS[handle] = (compiled, topk, ep, fp8, owner)
    return handle


def unregister(handle: int) -> None:
    _LAYERS.pop(handle, None)


def kernels_of(handle: int):
    """The registered layer's kernels (None for the reference backend)."""
    return _entry(handle)[0]


def _entry(layer: int):
    try:
        return _LAYERS[layer]
    except KeyError:
        raise RuntimeError(f"mokgen: layer handle {layer} was released (its module was "
                           "deleted before this call or its backward)") from None


def _f32(tensors):
    return [None if t is None else t.float() for t in tensors]


def _local_only(layer: int) -> int:
    _, topk, ep = _entry(layer)[:3]
    if ep != 1:
        raise NotImplementedError("mokgen: the reference path holds every expert on one rank "
                                  f"(ep == 1); got ep={ep}: run it on CUDA with the kernels")
    return topk


# ---------------------------------------------------------------- routing by mokgen
# The forward ops also return what their backward needs besides the inputs: the routes
# (experts int32 [n, k], weights fp32 [n, k]), `token`, a CPU int64 [1] naming the
# forward whose activations the layer's ring holds (-1: none; the backward then replays all)
# and last, for keep_h plans on CUDA, the call's own kept activations (_kept_shapes), which
# the backward ops take as `kept`.
_NO_TOKEN = -1


def _kept_shapes(layer: int, x: torch.Tensor) -> list:
    """Shapes of the tensors a CUDA forward of a keep_h layer keeps for its backward
    (runtime/workspace.py KeptActivations, in its tensors() order); [] otherwise."""
    from mokgen.compiler.lower import layer_spec
    from mokgen.runtime.workspace import KeptActivations

    kernels = _kernels(layer, x)
    if kernels is None or not kernels.plan.keep_h:
        return []
    return KeptActivations.shapes(layer_spec(kernels.plan), x.shape[0])


def _fake_kept(layer: int, x: torch.Tensor) -> list:
    return [x.new_empty(s, dtype=torch.bfloat16) for s in _kept_shapes(layer, x)]


def _token(v: int) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.int64)


def _kernels(layer: int, x: torch.Tensor, backward: bool = False):
    """The layer's compiled kernels for a CUDA call (for the backward: only if its shape has
    a backward kernel; the reference's explicit backward runs otherwise)."""
    compiled = _entry(layer)[0]
    if not (x.is_cuda and compiled is not None):
        return None
    return compiled if not backward or compiled.has_backward() else None


def _forward_impl(x, router_logits, w1, w2, shared_w1, shared_w2, layer) -> list:
    """-> [y, experts, weights, token, *kept] (moe_forward's body)."""
    kernels = _kernels(layer, x)
    if kernels is not None:
        y, (experts, weights), gen, kept = kernels.forward(x, router_logits, w1, w2, shared_w1,
                                                           shared_w2, save=True)
        return [y, experts, weights, _token(gen), *kept]
    topk = _local_only(layer)
    f = _f32((x, router_logits, w1, w2, shared_w1, shared_w2))
    experts, weights = reference.route(f[1], topk)
    y = reference.moe_forward_routed(f[0], experts, weights, *f[2:],
                                     fp8=_entry(layer)[3]).to(x.dtype)
    return [y, experts.int(), weights, _token(_NO_TOKEN)]


@torch.library.custom_op("mokgen::moe_forward", mutates_args=())
def moe_forward(x: torch.Tensor, router_logits: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor, shared_w1: torch.Tensor | None,
                shared_w2: torch.Tensor | None, layer: int) -> list[torch.Tensor]:
    """-> [y, experts, weights, token, *kept]."""
    return _forward_impl(x, router_logits, w1, w2, shared_w1, shared_w2, layer)


@moe_forward.register_fake
def _(x, router_logits, w1, w2, shared_w1, shared_w2, layer):
    topk = _entry(layer)[1]
    n = x.shape[0]
    return [torch.empty_like(x), x.new_empty(n, topk, dtype=torch.int32),
            x.new_empty(n, topk, dtype=torch.float32), torch.empty(1, dtype=torch.int64),
            *_fake_kept(layer, x)]


def _backward_impl(dy, x, router_logits, experts, weights, token, w1, w2, shared_w1, shared_w2,
                   acc_w1, acc_w2, kept, layer) -> list:
    """Gradients of (x, router_logits, w1, w2, shared_w1, shared_w2): the backward
    megakernel on CUDA, the reference's explicit backward otherwise (an op runs below
    autograd, so no autograd inside); empty tensors stand for absent shared ones. With
    acc_w1 / acc_w2 the expert weight gradients are added into them and returned empty."""
    like = (x, router_logits, w1, w2, shared_w1, shared_w2)
    kernels = _kernels(layer, x, backward=True)
    if kernels is not None:
        acc = _acc(acc_w1, acc_w2)
        dx, dweights, dw1, dw2, dsw1, dsw2 = kernels.backward(
            dy, x, w1, w2, shared_w1, shared_w2, (experts, weights), int(token[0]), acc, kept)
        dlogits = kernels.router_backward(router_logits, experts, dweights)
        return _cast((dx, dlogits, *_fused(dw1, dw2, acc), dsw1, dsw2), like)
    grads = reference.moe_backward(*_f32(like), _local_only(layer), dy.float(),
                                   fp8=_entry(layer)[3])
    return _cast(_add_into(grads, acc_w1, acc_w2), like)


@torch.library.custom_op("mokgen::moe_backward", mutates_args=())
def moe_backward(dy: torch.Tensor, x: torch.Tensor, router_logits: torch.Tensor,
                 experts: torch.Tensor, weights: torch.Tensor, token: torch.Tensor,
                 w1: torch.Tensor, w2: torch.Tensor, shared_w1: torch.Tensor | None,
                 shared_w2: torch.Tensor | None, kept: list[torch.Tensor],
                 layer: int) -> list[torch.Tensor]:
    """_backward_impl as an op of its own, so tracing sees its shapes (fake) instead of the
    data-dependent routing."""
    return _backward_impl(dy, x, router_logits, experts, weights, token, w1, w2, shared_w1,
                          shared_w2, None, None, kept, layer)


@moe_backward.register_fake
def _(dy, x, router_logits, experts, weights, token, w1, w2, shared_w1, shared_w2, kept, layer):
    return _fake_grads((x, router_logits, w1, w2, shared_w1, shared_w2))


@torch.library.custom_op("mokgen::moe_backward_into", mutates_args=("acc_w1", "acc_w2"))
def moe_backward_into(dy: torch.Tensor, x: torch.Tensor, router_logits: torch.Tensor,
                      experts: torch.Tensor, weights: torch.Tensor, token: torch.Tensor,
                      w1: torch.Tensor, w2: torch.Tensor, shared_w1: torch.Tensor | None,
                      shared_w2: torch.Tensor | None, acc_w1: torch.Tensor,
                      acc_w2: torch.Tensor, kept: list[torch.Tensor],
                      layer: int) -> list[torch.Tensor]:
    """moe_backward adding the expert weight gradients into acc_w1 / acc_w2 (fused gradient
    accumulation; eager only, `_accumulate_into`); they come back empty."""
    return _backward_impl(dy, x, router_logits, experts, weights, token, w1, w2, shared_w1,
                          shared_w2, acc_w1, acc_w2, kept, layer)


@moe_backward_into.register_fake
def _(dy, x, router_logits, experts, weights, token, w1, w2, shared_w1, shared_w2, acc_w1,
      acc_w2, kept, layer):
    return _fake_grads((x, router_logits, w1, w2, shared_w1, shared_w2), fused=True)


# ---------------------------------------------------------------- routes from the caller
def _forward_routed_impl(x, experts, weights, w1, w2, shared_w1, shared_w2, layer) -> list:
    """-> [y, token, *kept] (moe_forward_routed's body)."""
    kernels = _kernels(layer, x)
    if kernels is not None:
        y, _, gen, kept = kernels.forward(x, None, w1, w2, shared_w1, shared_w2,
                                          routes=(experts, weights), save=True)
        return [y, _token(gen), *kept]
    _local_only(layer)
    f = _f32((x, w1, w2, shared_w1, shared_w2))
    y = reference.moe_forward_routed(f[0], experts, weights.float(), *f[1:],
                                     fp8=_entry(layer)[3]).to(x.dtype)
    return [y, _token(_NO_TOKEN)]


@torch.library.custom_op("mokgen::moe_forward_routed", mutates_args=())
def moe_forward_routed(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                       w1: torch.Tensor, w2: torch.Tensor, shared_w1: torch.Tensor | None,
                       shared_w2: torch.Tensor | None, layer: int) -> list[torch.Tensor]:
    """-> [y, token, *kept]."""
    return _forward_routed_impl(x, experts, weights, w1, w2, shared_w1, shared_w2, layer)


@moe_forward_routed.register_fake
def _(x, experts, weights, w1, w2, shared_w1, shared_w2, layer):
    return [torch.empty_like(x), torch.empty(1, dtype=torch.int64), *_fake_kept(layer, x)]


def _backward_routed_impl(dy, x, experts, weights, token, w1, w2, shared_w1, shared_w2,
                          acc_w1, acc_w2, kept, layer) -> list:
    """Gradients of (x, weights, w1, w2, shared_w1, shared_w2); see _backward_impl."""
    like = (x, weights, w1, w2, shared_w1, shared_w2)
    kernels = _kernels(layer, x, backward=True)
    if kernels is not None:
        acc = _acc(acc_w1, acc_w2)
        dx, dweights, dw1, dw2, dsw1, dsw2 = kernels.backward(
            dy, x, w1, w2, shared_w1, shared_w2, (experts, weights), int(token[0]), acc, kept)
        return _cast((dx, dweights, *_fused(dw1, dw2, acc), dsw1, dsw2), like)
    _local_only(layer)
    f = _f32((x, w1, w2, shared_w1, shared_w2))
    grads = reference.moe_backward_routed(f[0], experts, weights.float(), *f[1:], dy.float(),
                                          fp8=_entry(layer)[3])
    return _cast(_add_into(grads, acc_w1, acc_w2), like)


@torch.library.custom_op("mokgen::moe_backward_routed", mutates_args=())
def moe_backward_routed(dy: torch.Tensor, x: torch.Tensor, experts: torch.Tensor,
                        weights: torch.Tensor, token: torch.Tensor, w1: torch.Tensor,
                        w2: torch.Tensor, shared_w1: torch.Tensor | None,
                        shared_w2: torch.Tensor | None, kept: list[torch.Tensor],
                        layer: int) -> list[torch.Tensor]:
    """_backward_routed_impl as an op (see moe_backward)."""
    return _backward_routed_impl(dy, x, experts, weights, token, w1, w2, shared_w1, shared_w2,
                                 None, None, kept, layer)


@moe_backward_routed.register_fake
def _(dy, x, experts, weights, token, w1, w2, shared_w1, shared_w2, kept, layer):
    return _fake_grads((x, weights, w1, w2, shared_w1, shared_w2))


@torch.library.custom_op("mokgen::moe_backward_routed_into", mutates_args=("acc_w1", "acc_w2"))
def moe_backward_routed_into(dy: torch.Tensor, x: torch.Tensor, experts: torch.Tensor,
                             weights: torch.Tensor, token: torch.Tensor, w1: torch.Tensor,
                             w2: torch.Tensor, shared_w1: torch.Tensor | None,
                             shared_w2: torch.Tensor | None, acc_w1: torch.Tensor,
                             acc_w2: torch.Tensor, kept: list[torch.Tensor],
                             layer: int) -> list[torch.Tensor]:
    """moe_backward_routed adding into acc_w1 / acc_w2 (see moe_backward_into)."""
    return _backward_routed_impl(dy, x, experts, weights, token, w1, w2, shared_w1, shared_w2,
                                 acc_w1, acc_w2, kept, layer)


@moe_backward_routed_into.register_fake
def _(dy, x, experts, weights, token, w1, w2, shared_w1, shared_w2, acc_w1, acc_w2, kept,
      layer):
    return _fake_grads((x, weights, w1, w2, shared_w1, shared_w2), fused=True)


# ---------------------------------------------------------------- fused accumulation
def _accumulate_into(layer: int, x, w1, w2) -> tuple:
    """(.grad of the owner's w1, w2, or of the slices of them this rank's experts are) where
    the layer fuses gradient accumulation into its CUDA backward, the owner's parameters are
    the weights this call used (the owner's `expert_grads(w1, w2)` says), and both hold a
    gradient it can add into (bf16, contiguous, the weights' shapes; eager only: the *_into
    ops mutate, which tracing would have to functionalize); else (): autograd adds what the op
    returns, as usual. The owner's, not the saved tensors': activation checkpointing saves
    detached aliases of the parameters, whose .grad is not the parameter's."""
    owner = _entry(layer)[4]
    module = owner() if owner is not None else None
    if module is None or not fuses(module.fuse_grad_accumulation) or \
            not _plain_eager((x, w1, w2)) or _kernels(layer, x, backward=True) is None:
        return ()  # traced (torch.compile's AOT backward runs here on functional / fake
        # tensors), or no CUDA kernels
    targets = module.expert_grads(w1, w2)
    if targets is None or not engine_accumulates(module.expert_params()):
        return ()  # other storage (e.g. a parallel wrapper's copies), no .grad, or a backward
        # that does not accumulate into them: autograd's path
    g1, g2 = targets
    ok = all(g is not None and g.dtype == torch.bfloat16 and g.shape == w.shape
             and g.is_contiguous() and not g.requires_grad for g, w in ((g1, w1), (g2, w2)))
    return (g1, g2) if ok else ()


def fuses(mode) -> bool:
    """A layer's fuse_grad_accumulation, now: True; None (the default) where no
    torch.distributed process group is initialized (one process: no DDP, whose hooks on the
    experts' gradient accumulation engine_accumulates cannot see); False never."""
    if mode is None:
        return not (torch.distributed.is_available() and torch.distributed.is_initialized())
    return bool(mode)


def engine_accumulates(params) -> bool:
    """Whether the running backward accumulates into every one of these leaf parameters'
    .grad with nothing else to see their gradient; called inside a backward. Not where:
    - the engine will not run their AccumulateGrad nodes: torch.autograd.grad, or
      backward(inputs=...) without them, asks for other gradients, and adding into .grad
      there would change what the caller did not ask to change (and return them no
      gradient);
    - a hook is registered on their gradient (Tensor.register_hook) or after its
      accumulation (register_post_accumulate_grad_hook): autograd sees no gradient for them
      on the fused path, so the hooks would not run.
    Hooks registered from C++ on the AccumulateGrad node (DDP's reducer) are not visible
    here: mokgen.MoE's docstring says so."""
    from torch.autograd.graph import get_gradient_edge

    for p in params:
        if not (p.is_leaf and p.requires_grad) or p._backward_hooks or \
                getattr(p, "_post_accumulate_grad_hooks", None):
            return False
        try:
            if not torch._C._will_engine_execute_node(get_gradient_edge(p).node):
                return False
        except RuntimeError as e:  # torch refuses leaves inside autograd.grad, which never
            if "autograd.grad" in str(e):  # touches .grad
                return False
            raise
    return True


def _add_into(grads, acc_w1, acc_w2) -> list:
    """The reference path's side of the ops' contract: expert gradients (fp32) added into
    the targets with one rounding (the kernels' register path; their TMA path rounds the
    gradient to bf16 first, as autograd's add does), and not returned."""
    grads = list(grads)
    if acc_w1 is not None:
        for acc, g in ((acc_w1, grads[2]), (acc_w2, grads[3])):
            acc.copy_(acc.float() + g)
        grads[2] = grads[3] = None
    return grads


def _acc(acc_w1, acc_w2):
    """The kernels' `accumulate` argument: one rank's (dw1, dw2), or None."""
    return None if acc_w1 is None else [(acc_w1, acc_w2)]


# ---------------------------------------------------------------- autograd wiring
def _cast(grads, like) -> list:
    """Gradients in their inputs' dtypes; an empty tensor for an absent input."""
    return [like[0].new_empty(0) if g is None else g.to(t.dtype) for g, t in zip(grads, like)]


def _fused(dw1, dw2, acc) -> tuple:
    """The expert weight gradients the op returns: none where they were added in place."""
    return (None, None) if acc is not None else (dw1, dw2)


def _fake_grads(like, fused: bool = False) -> list:
    return [like[0].new_empty(0) if t is None or (fused and i in (2, 3)) else
            torch.empty_like(t) for i, t in enumerate(like)]


def _grads_out(g, has_shared: bool, fused: bool) -> list:
    """The op's 6 gradients with empty placeholders turned back into None."""
    experts = [None, None] if fused else list(g[2:4])
    return list(g[:2]) + experts + ([g[4], g[5]] if has_shared else [None, None])


def _setup_with(extra: int):
    """setup_context of a forward op returning y and `extra` more outputs before its kept
    activations: saves the inputs (None-free) and the extra outputs (routes, token, kept)."""
    def setup(ctx, inputs, output):
        # no zero gradients made up for the outputs nothing differentiates (routes, kept
        # activations: a keep_h call's h would get one as large as itself, raising the step's
        # peak by as much); an unused y's is made in _dy
        ctx.set_materialize_grads(False)
        tensors = inputs[:-1]
        ctx.has_shared = tensors[-2] is not None
        ctx.n_kept = len(output) - 1 - extra
        ctx.save_for_backward(*[t for t in tensors if t is not None], *output[1:])
        ctx.layer = inputs[-1]
    return setup


def _kept_of(ctx, saved: list) -> tuple[list, list]:
    """(saved without the kept activations, the kept activations)."""
    k = ctx.n_kept
    return (saved[:-k], saved[-k:]) if k else (saved, [])


def _dy(grads, x):
    """The output gradient of y (a list-returning op's backward gets the list); zeros where
    y was not used (gradients are not materialized: _setup_with)."""
    g = grads[0]
    g = g[0] if isinstance(g, (list, tuple)) else g
    return torch.zeros_like(x) if g is None else g


def _grads(ctx, args, acc, kept, body, op, op_into) -> list:
    """A backward's gradients: its body run directly for an eager call (ctx.eager: no
    dispatcher), else its op, or the op's *_into twin where they are added into `acc`."""
    if getattr(ctx, "eager", False):
        return body(*args, *(acc or (None, None)), kept, ctx.layer)
    return op_into(*args, *acc, kept, ctx.layer) if acc else op(*args, kept, ctx.layer)


def _backward(ctx, *grads):
    # x, logits, w1, w2[, sw1, sw2], experts, weights, token[, kept...]
    saved, kept = _kept_of(ctx, list(ctx.saved_tensors))
    x, logits, w1, w2 = saved[:4]
    dy = _dy(grads, x)
    shared = saved[4:6] if ctx.has_shared else [None, None]
    experts, weights, token = saved[-3:]
    args = (dy, x, logits, experts, weights, token, w1, w2, *shared)
    acc = _accumulate_into(ctx.layer, x, w1, w2)
    g = _grads(ctx, args, acc, kept, _backward_impl, moe_backward, moe_backward_into)
    return (*_grads_out(g, ctx.has_shared, bool(acc)), None)


def _backward_routed(ctx, *grads):
    # x, experts, weights, w1, w2[, sw1, sw2], token[, kept...]
    saved, kept = _kept_of(ctx, list(ctx.saved_tensors))
    dy = _dy(grads, saved[0])
    shared = saved[5:7] if ctx.has_shared else [None, None]
    args = (dy, *saved[:3], saved[-1], *saved[3:5], *shared)
    acc = _accumulate_into(ctx.layer, saved[0], *saved[3:5])
    g = _grads(ctx, args, acc, kept, _backward_routed_impl, moe_backward_routed,
               moe_backward_routed_into)
    dx, dweights, dw1, dw2, dsw1, dsw2 = _grads_out(g, ctx.has_shared, bool(acc))
    return dx, None, dweights, dw1, dw2, dsw1, dsw2, None


moe_forward.register_autograd(_backward, setup_context=_setup_with(3))
moe_forward_routed.register_autograd(_backward_routed, setup_context=_setup_with(1))


# ---------------------------------------------------------------- eager calls
# A custom op with autograd costs the host ~1 ms a training step in PyTorch's dispatcher and
# its autograd wrapper, about a fifth of a lone step's GPU time on Qwen3-30B, and in a stack
# of layers the GPU waits for it. So plain eager calls run the same bodies under an
# autograd.Function with the same saving and backward (_setup_with, _backward*: bitwise the
# ops' results); the ops remain what torch.compile, torch-function or dispatch modes, tensor
# subclasses (FSDP2's DTensors) and functorch transforms see.
def _plain_eager(tensors) -> bool:
    """Whether a call with these tensors may skip the dispatcher: eager, no mode, no
    transform, only plain tensors and parameters."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or
                torch._C._is_torch_function_mode_enabled() or
                torch._C._functorch.peek_interpreter_stack() is not None) and \
        all(t is None or type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


def _eager_function(body, extra: int, backward_of):
    setup = _setup_with(extra)

    class Eager(torch.autograd.Function):
        # forward with ctx, no setup_context: apply() then skips binding the arguments to
        # the signature (inspect, ~25 us a call), which only functorch needs
        @staticmethod
        def forward(ctx, *inputs):
            output = tuple(body(*inputs))
            setup(ctx, inputs, output)
            ctx.eager = True  # the backward runs the bodies, not the backward ops
            ctx.mark_non_differentiable(*output[1:])
            return output

        backward = staticmethod(backward_of)

    return Eager


_EagerForward = _eager_function(_forward_impl, 3, _backward)
_EagerForwardRouted = _eager_function(_forward_routed_impl, 1, _backward_routed)


def _no_backward_kernels(layer: int, args):
    """The layer's CUDA kernels where a plain eager call can have no backward (grad mode off,
    or no input requiring grad): its forward then keeps no activations (save=False: no kept
    h, no bf16 copies of an fp8 layer's h and a), as an inference call should. Else None."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args):
        return None
    return _kernels(layer, args[0])


def moe(x, router_logits, w1, w2, shared_w1, shared_w2, layer: int) -> torch.Tensor:
    """y of moe_forward: through the op, or for a plain eager call (_plain_eager) the same
    body and backward without the dispatcher (with no backward to come: the kernels alone,
    keeping nothing)."""
    args = (x, router_logits, w1, w2, shared_w1, shared_w2)
    if _plain_eager(args):
        kernels = _no_backward_kernels(layer, args)
        if kernels is not None:
            return kernels.forward(*args, save=False)[0]
        return _EagerForward.apply(*args, layer)[0]
    return moe_forward(*args, layer)[0]


def moe_routed(x, experts, weights, w1, w2, shared_w1, shared_w2, layer: int) -> torch.Tensor:
    """y of moe_forward_routed, as `moe`."""
    args = (x, experts, weights, w1, w2, shared_w1, shared_w2)
    if _plain_eager(args):
        kernels = _no_backward_kernels(layer, args)
        if kernels is not None:
            return kernels.forward(x, None, w1, w2, shared_w1, shared_w2,
                                   routes=(experts, weights), save=False)[0]
        return _EagerForwardRouted.apply(*args, layer)[0]
    return moe_forward_routed(*args, layer)[0]
