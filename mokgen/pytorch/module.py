"""mokgen.MoE: an nn.Module owning the router, the local experts and the shared expert.

Parameters use the layouts of docs/design.md ("Math": the nn.Linear convention), under the
same names as `mokgen.reference.ReferenceMoE`, so state dicts move between the two unchanged:
router.weight [E, D], w1 [L, 2I, D] (gate rows, then up rows), w2 [L, D, I],
shared_w1 [2 I_s, D], shared_w2 [D, I_s]; L = E / ep, rank r holding experts r*L .. r*L+L-1.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from mokgen.pytorch import ops
from mokgen.shapes import MoEShape

_DTYPES = {"bf16": torch.bfloat16}


class MoE(nn.Module):
    def __init__(self, shape: MoEShape, ep_group=None, dtype: str = "bf16",
                 tokens_per_rank: int = 2048, router: bool = True, device=None,
                 backend: str = "kernels", overlap_comm: bool = False,
                 fuse_grad_accumulation: bool | None = None, **overrides):
        """overlap_comm=True: collectives (FSDP gathers, gradient reduce-scatters) run beside
        this layer; its kernels leave them SMs (the plan's reserve_sms, H100 / H200: 16; see
        mokgen/compiler/passes/sm_partition.py). Cap NCCL to as many CTAs (NCCL_MAX_CTAS).

        The layer is planned for the GPU of `device` (a CUDA device with an index), else for
        the current one (mokgen.compile's default); `gpu=` names another ("h100-sxm", ...).

        fuse_grad_accumulation (fused gradient accumulation): when w1.grad and w2.grad
        already hold gradients (accumulation over micro-batches), the backward kernel adds
        the expert weight gradients into them instead of returning new tensors for autograd
        to add: no temporary the size of the expert weights, no separate add (also under
        activation checkpointing). A whole expert's bf16 gradient tile is added by a TMA
        reduction (the roundings of autograd's add); an expert whose rows span several passes
        of the ring, and every expert in kernels without the weight gradients' staging (fp8
        plans'), adds its fp32 sum rounding once. On such calls autograd sees no gradient
        for w1 / w2, so it fuses only in a backward that accumulates into both
        (not torch.autograd.grad, nor backward(inputs=...) without them) and where no Python
        hook watches their gradient (Tensor.register_hook,
        register_post_accumulate_grad_hook): those take the ordinary path
        (ops.engine_accumulates). DDP's hooks are registered from C++ where this cannot see
        them: for plain loops (tested), not DDP; FSDP2 reads .grad after the backward, so it
        should hold there too (not tested). The first backward (grads None) and
        torch.compile'd code take the ordinary path. None (the default): fused where no
        torch.distributed process group is initialized when the backward runs (one-process
        training; DDP needs a process group), ordinary otherwise; True: fused with one too
        (plain loops, FSDP2; not DDP); False: never."""
        super().__init__()
        if overlap_comm:
            overrides = {"overlap_comm": True, **overrides}
        if not isinstance(shape, MoEShape):
            raise TypeError(f"shape must be a mokgen.MoEShape, got {type(shape).__name__}")
        if backend not in ("kernels", "reference"):
            raise ValueError(f"backend must be 'kernels' or 'reference', got {backend!r}")
        from mokgen.compiler.tuned import tuned_plan

        self.ep_group = ep_group
        ep, self.rank = group_size_rank(ep_group)
        if "gpu" not in overrides and "arch" not in overrides:
            overrides = {**overrides, **target_of(device)}
        self.plan = tuned_plan(shape, ep, dtype, tokens_per_rank, **overrides)  # as compile()
        self.shape, self.dtype_name = shape, dtype
        E, D, I, L = shape.num_experts, shape.hidden, shape.intermediate, self.plan.local_experts
        pdt = _DTYPES.get(dtype, torch.bfloat16)  # mxfp8 quantizes bf16 master weights
        kw = dict(device=device, dtype=pdt)
        self.router = nn.Linear(D, E, bias=False, device=device) if router else None
        self.w1 = nn.Parameter(torch.empty(L, 2 * I, D, **kw))
        self.w2 = nn.Parameter(torch.empty(L, D, I, **kw))
        if shape.shared_experts:
            self.shared_w1 = nn.Parameter(torch.empty(2 * shape.shared_dim, D, **kw))
            self.shared_w2 = nn.Parameter(torch.empty(D, shape.shared_dim, **kw))
        else:
            self.register_parameter("shared_w1", None)
            self.register_parameter("shared_w2", None)
        self.reset_parameters()
        LayerRegistration.attach(self, self.plan, ep_group, backend, fuse_grad_accumulation)

    @property
    def _layer(self) -> int:
        """The int the custom ops take for this layer."""
        return self._registration.handle

    def memory(self) -> dict:
        """What this layer holds on the device beyond its parameters (see
        CompiledMoE.memory; zeros before the first CUDA call or with backend="reference")."""
        kernels = ops.kernels_of(self._layer)
        if kernels is None or kernels.compiled is None:
            return {"workspace": 0, "workspace_held": 0, "layers_sharing": 0,
                    "saved_per_call": 0}
        return kernels.compiled.memory()

    def expert_grads(self, w1: torch.Tensor, w2: torch.Tensor):
        """(w1.grad, w2.grad) when the call's expert weights are this module's (the same
        storage: checkpointing saves detached aliases of them), else None. Read by the fused
        gradient accumulation (ops._accumulate_into), which checks the gradients' layout."""
        p1, p2 = self.expert_params()
        if p1.data_ptr() != w1.data_ptr() or p2.data_ptr() != w2.data_ptr():
            return None
        if p1.grad is None or p2.grad is None:
            return None
        return p1.grad, p2.grad

    def expert_params(self) -> tuple:
        """The parameters whose .grad expert_grads returns (ops.engine_accumulates checks
        that the running backward accumulates into them)."""
        return self.w1, self.w2

    def reset_parameters(self) -> None:
        """Normal(0, 1/fan_in) expert weights: outputs stay O(1) whatever D and I are."""
        s = self.shape
        with torch.no_grad():
            self.w1.normal_(0.0, s.hidden ** -0.5)
            self.w2.normal_(0.0, s.intermediate ** -0.5)
            if self.shared_w1 is not None:
                self.shared_w1.normal_(0.0, s.hidden ** -0.5)
                self.shared_w2.normal_(0.0, s.shared_dim ** -0.5)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor | None = None,
                routes: tuple | None = None):
        """y for x [..., D]. Routing: the module's own router (router=True); or the caller's
        `router_logits` [..., E] routed by mokgen's softmax top-k; or the caller's own
        `routes = (experts int [..., k], weights [..., k])`, whose gradient flows to weights."""
        s = self.shape
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2 or x.shape[-1] != s.hidden:
            raise ValueError(f"x must have shape (..., {s.hidden}), got {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, s.hidden)
        n = x2.shape[0]
        if n > self.plan.tokens_per_rank:
            raise ValueError(f"x has {n} tokens, more than tokens_per_rank="
                             f"{self.plan.tokens_per_rank} this layer was planned for")
        given = [name for name, v in (("router_logits", router_logits), ("routes", routes))
                 if v is not None]
        if self.router is not None and given:
            raise ValueError(f"{given[0]} must be None: this MoE owns its router")
        if self.router is None and len(given) != 1:
            raise ValueError("a MoE without router (router=False) needs exactly one of "
                             "router_logits or routes")
        xw = x2.to(self.w1.dtype)
        weights = (self.w1, self.w2, self.shared_w1, self.shared_w2)
        if routes is not None:
            experts, wts = self._check_routes(routes, n)
            y = ops.moe_routed(xw, experts, wts, *weights, self._layer)
        else:
            logits = (self.router(x2.to(self.router.weight.dtype)) if self.router is not None
                      else router_logits.reshape(-1, s.num_experts)).float()
            y = ops.moe(xw, logits, *weights, self._layer)
        return y.to(x.dtype).reshape(*lead, s.hidden)

    def _check_routes(self, routes, n: int):
        s = self.shape
        if not (isinstance(routes, (tuple, list)) and len(routes) == 2 and
                all(isinstance(t, torch.Tensor) for t in routes)):
            raise TypeError("routes must be a pair of tensors (experts, weights)")
        experts, wts = (t.reshape(n, -1) for t in routes)
        if experts.shape != (n, s.topk) or wts.shape != (n, s.topk):
            raise ValueError(f"routes must both have shape (..., {s.topk}) for {n} tokens, got "
                             f"{tuple(routes[0].shape)} and {tuple(routes[1].shape)}")
        if experts.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"routes[0] (experts) must be int32 or int64, got {experts.dtype}")
        if not wts.is_floating_point():
            raise TypeError(f"routes[1] (weights) must be floating point, got {wts.dtype}")
        return experts.long().contiguous(), wts.float().contiguous()

    def extra_repr(self) -> str:
        s = self.shape
        return (f"E={s.num_experts}, D={s.hidden}, I={s.intermediate}, k={s.topk}, "
                f"ep={self.plan.ep}, rank={self.rank}, dtype={self.dtype_name}")


def target_of(device) -> dict:
    """{"gpu": device's GPU} for a CUDA device with an index, else {} (the plan's default:
    the current device)."""
    if device is None:
        return {}
    d = torch.device(device)
    if d.type != "cuda" or d.index is None:
        return {}
    from mokgen.compiler import hardware

    return {"gpu": hardware.device(d.index)}


def group_size_rank(ep_group) -> tuple:
    """(ep, rank) of a process group; (1, 0) without one."""
    if ep_group is None:
        return 1, 0
    import torch.distributed as dist

    return dist.get_world_size(ep_group), dist.get_rank(ep_group)


class LayerRegistration:
    """A layer's entry in the custom ops' registry (ops take an int, not Python objects),
    registered now (not under torch.compile tracing) and released with its module: the
    entry holds the layer's kernels and, through them, its share of the workspace, which
    goes with the last layer of its plan. A deep copy of the module registers anew.
    Kernels are compiled on the first CUDA call; backend="reference" runs the PyTorch
    reference on every device (for comparisons)."""

    def __init__(self, plan, ep_group=None, backend: str = "kernels", owner=None):
        self.args, self.owner = (plan, ep_group, backend), owner
        self.kernels = _LazyKernels(plan, ep_group) if backend == "kernels" else None
        self.handle = ops.register(self.kernels, plan.shape.topk, plan.ep,
                                   None if plan.dtype == "bf16" else plan.dtype, owner)

    def share(self) -> "LayerRegistration":
        """One more module calls through this registration (torchtitan's blocks of one plan):
        the layer's fp8 weight cache then keeps a weight set for each caller."""
        if self.kernels is not None:
            self.kernels.weight_sets += 1
        return self

    @classmethod
    def attach(cls, module, plan, ep_group, backend: str, fuse_grad_accumulation) -> None:
        """Registers `module`'s layer as its `_registration` and keeps its
        fuse_grad_accumulation (read by ops._accumulate_into): the module owns the entry (its
        weight gradients may be accumulated into by the kernels) unless that is False."""
        module._registration = cls(plan, ep_group, backend, None if fuse_grad_accumulation
                                   is False else weakref.ref(module))
        module.fuse_grad_accumulation = fuse_grad_accumulation

    def __deepcopy__(self, memo):
        # the copy of the owning module (deepcopy made it first) owns the new registration
        owner = self.owner() if self.owner is not None else None
        copy = memo.get(id(owner)) if owner is not None else None
        new = LayerRegistration(*self.args, weakref.ref(copy) if copy is not None else None)
        if new.kernels is not None:  # a model's copy calls it from as many modules
            new.kernels.weight_sets = self.kernels.weight_sets
        return new

    def __del__(self):
        unregister = getattr(ops, "unregister", None)  # None at interpreter shutdown
        if unregister is not None:
            unregister(self.handle)


class _LazyKernels:
    """Compiles the layer's kernels on the first CUDA call: this rank's layer, called with
    this rank's tensors (without a process group the one rank holds every expert)."""

    def __init__(self, plan, group):
        self.plan, self.group, self.compiled = plan, group, None
        self.weight_sets = 1  # modules calling through it (LayerRegistration.share)

    def layer(self):
        from mokgen.pytorch.api import compile_layer

        if self.compiled is None:
            self.compiled = compile_layer(self.plan, group=self.group)
        self.compiled.weight_sets = self.weight_sets
        return self.compiled

    def forward(self, x, logits, w1, w2, sw1, sw2, routes=None, save=False):
        """-> (y, routes (experts, weights) of x's tokens if save, generation, the tensors of
        the call's kept activations (keep_h plans with save; else []))."""
        c = self.layer()
        xs, zs, w1s, w2s, given = c._checked(x, logits, w1, w2, sw1, sw2, routes)
        ys, rts, gen, kept = c.forward_raw(xs, None if given else zs, w1s, w2s, sw1, sw2,
                                           given, save)
        return ys[0], (rts[0] if rts else None), gen, kept[0].tensors() if kept else []

    def has_backward(self) -> bool:
        return "bwd" in self.layer().binaries

    def backward(self, dy, x, w1, w2, sw1, sw2, routes, generation, accumulate=None,
                 kept=()):
        """-> (dx, dweights [n, k], dw1, dw2, dshared_w1, dshared_w2); `accumulate`: one
        rank's [(dw1, dw2)] to add into (CompiledMoE.backward_raw); `kept`: the forward's
        kept activations' tensors (keep_h plans)."""
        from mokgen.runtime.workspace import KeptActivations

        dxs, dws, dw1s, dw2s, dsw1, dsw2 = self.layer().backward_raw(
            [dy], [x], [w1], [w2], sw1, sw2, [routes], generation, accumulate,
            [KeptActivations.of(list(kept))] if kept else None)
        return dxs[0], dws[0], dw1s[0], dw2s[0], dsw1, dsw2

    def router_backward(self, logits, experts, dweights):
        return self.layer().router_backward(logits, experts, dweights)

    def __call__(self, x, logits, w1, w2, sw1, sw2, routes=None):
        return self.forward(x, logits, w1, w2, sw1, sw2, routes)[0]
