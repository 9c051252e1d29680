"""plan -> emit -> build -> (load): the compiled layer a user calls."""
from __future__ import annotations

import time

import torch

from . import build, codegen
from .config import CONFIG
from .plan import Plan


class CompiledMoE:
    """`moe(x, router_logits, w1, w2, shared_w1, shared_w2) -> y`.

    Real ranks: tensors of this rank. Virtual ranks (`virtual=True`): lists of R tensors for
    x, router_logits, w1, w2 (rank r's w1/w2 hold global experts r*L .. r*L+L-1), single
    shared weights; returns the list of R outputs. No host synchronization inside a call.
    """

    def __init__(self, plan: Plan, binaries: dict, virtual: bool, build_seconds: float,
                 group=None, watchdog_s: float | None = None):
        self.plan, self.binaries, self.virtual = plan, binaries, virtual
        self.build_seconds = build_seconds
        self.group = group
        self.watchdog_s = CONFIG.watchdog_s if watchdog_s is None else watchdog_s
        self._runtime = None

    @property
    def resources(self) -> dict:
        return {name: b.resources for name, b in self.binaries.items()}

    def runtime(self):
        if self._runtime is None:
            if not torch.cuda.is_available():
                raise RuntimeError("mokgen: running a compiled layer needs a CUDA GPU; "
                                   "none is visible (compiling works without one)")
            from .runtime.moe import ForwardRuntime, LayerSpec

            p, s = self.plan, self.plan.shape
            spec = LayerSpec(s.num_experts, s.hidden, s.intermediate, s.shared_dim, s.topk,
                             p.ep, p.tokens_per_rank, p.block_m, p.minibatch, p.macrobatch,
                             p.comm_sms_fwd, p.max_routed_rows)
            self._runtime = ForwardRuntime(spec, str(self.binaries["prologue"].path),
                                           str(self.binaries["fwd"].path), self.virtual,
                                           self.group, self.watchdog_s)
        return self._runtime

    def __call__(self, x, router_logits, w1, w2, shared_w1=None, shared_w2=None, routes=None):
        """`routes=(experts [n, k], weights [n, k])` (lists of them for virtual ranks) replaces
        mokgen's routing by the caller's; then router_logits must be None."""
        from .runtime.checks import check_inputs, check_routes

        many = self.virtual
        one = (lambda v: v) if many else (lambda v: [v])  # noqa: E731
        xs, w1s, w2s = one(x), one(w1), one(w2)
        given = None
        if routes is not None:
            if router_logits is not None:
                raise ValueError("give router_logits or routes, not both")
            zs = [None] * (len(xs) if isinstance(xs, (list, tuple)) else 1)
        else:
            zs = one(router_logits)
        zs = check_inputs(self.plan, xs, zs, w1s, w2s, shared_w1, shared_w2, many)
        if routes is not None:  # after x is known good: the routes are checked against it
            given = check_routes(self.plan, xs, routes if many else [routes], many)
        rt = self.runtime()
        rt.check()  # an earlier call's watchdog record, if any (no device sync)
        ys = rt.forward(xs, zs, w1s, w2s, shared_w1, shared_w2, routes=given)
        return ys if many else ys[0]

    def synchronize(self) -> None:
        """Wait for this layer's work and raise what the watchdog recorded, if anything."""
        torch.cuda.synchronize()
        self.runtime().check()


def compile_layer(plan: Plan, virtual: bool = False, group=None,
                  watchdog_s: float | None = None) -> CompiledMoE:
    if watchdog_s is not None and not watchdog_s > 0:
        raise ValueError(f"watchdog_s must be a positive number of seconds, got {watchdog_s!r}")
    t0 = time.perf_counter()
    kernels = codegen.emit(plan)
    bins = build.build(kernels, arch=plan.arch)
    names = [k.name.split("_")[0] for k in kernels]
    return CompiledMoE(plan, dict(zip(names, bins)), virtual, time.perf_counter() - t0, group,
                       watchdog_s)
