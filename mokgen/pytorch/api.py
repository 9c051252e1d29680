"""plan -> emit -> build -> (load): the compiled layer a user calls."""
from __future__ import annotations

import time

import torch

from mokgen.compiler import build, codegen
from mokgen.compiler.lower import layer_spec
from mokgen.config import CONFIG
from mokgen.compiler.plan import Plan


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
        self._backward = None
        self._weights = None
        # how many layers' weights this one compiled layer is called with (torchtitan's blocks
        # of one plan share it): its fp8 weight cache keeps a set per rank for each, as a
        # compiled layer per block would, so a backward finds what its forward quantized
        self.weight_sets = 1
        # One real rank hands its workspace back between calls (ForwardRuntime.release): out
        # of the step's peak, which falls between calls. Virtual ranks (tests and benchmarks
        # read their buffers after a call) and real peers (symmetric memory) keep theirs.
        self.releases_workspace = not virtual and plan.ep == 1

    @property
    def resources(self) -> dict:
        return {name: b.resources for name, b in self.binaries.items()}

    def runtime(self):
        """The forward runtime: the workspace of every layer of this plan on this device and
        group (one per model, not per layer; runtime/workspace.py), made on first use."""
        if self._runtime is None:
            if not torch.cuda.is_available():
                raise RuntimeError("mokgen: running a compiled layer needs a CUDA GPU; "
                                   "none is visible (compiling works without one)")
            from mokgen.runtime.checks import check_gpu
            from mokgen.runtime.moe import ForwardRuntime
            from mokgen.runtime.weight_quant import WeightCache
            from mokgen.runtime.workspace import shared

            p = self.plan
            check_gpu(p.gpu, p.gpu_sms, p.gpu_smem, torch.cuda.current_device())

            spec = layer_spec(self.plan)
            # one rank has no peers: it needs no process group (nor symmetric memory)
            hosted_virtual = self.virtual or self.plan.ep == 1
            self._runtime = shared(
                self._pool_key(), lambda: ForwardRuntime(
                    spec, self.binaries["prologue"].image, self.binaries["fwd"].image,
                    hosted_virtual, None if hosted_virtual else self.group, self.watchdog_s))
            self._runtime.layers.add(self)
            self._weights = WeightCache(spec.scale_block, self._runtime.hosted,
                                        self._runtime.prologue.module)
        self._weights.slots = self._runtime.hosted * self.weight_sets
        self._runtime.weights = self._weights  # this layer's fp8 weights (see ForwardRuntime)
        return self._runtime

    def backward_runtime(self):
        """The backward megakernel's runtime on the shared forward workspace (lazy)."""
        if self._backward is None:
            from mokgen.runtime.moe_bwd import BackwardPass
            from mokgen.runtime.workspace import shared

            if "bwd" not in self.binaries:
                raise ValueError(f"mokgen: no backward for this layer: "
                                 f"{codegen.backward_unsupported(self.plan)}")
            rt = self.runtime()
            self._backward = shared(self._pool_key() + ("bwd",),
                                    lambda: BackwardPass(rt, self.binaries["bwd"].image, *(
                                        [self.binaries["bwdres"].image]
                                        if "bwdres" in self.binaries else [])))
        self.runtime()  # binds this layer's weight cache
        return self._backward

    def _pool_key(self) -> tuple:
        """What makes two layers' workspaces interchangeable: the kernels (their plan), the
        device, the ranks' group and the watchdog bound."""
        g = self.group
        group = None if self.virtual or self.plan.ep == 1 else (
            getattr(g, "group_name", None) or id(g))
        return (self.plan.key(), self.binaries["fwd"].key, torch.cuda.current_device(),
                self.virtual, group, self.watchdog_s)

    def memory(self) -> dict:
        """Device bytes of this layer beyond its weights: `workspace` (what a call holds,
        shared with every live layer of the same plan on this device and group: the most
        any call held), `workspace_held` (allocated now: 0 between calls where the layer
        releases it, `releases_workspace`), `layers_sharing` it, and `saved_per_call` (what
        one differentiable call keeps for its backward: x, logits, routes and, keep_h plans,
        its h). The plan's `memory_report` predicts the same before any GPU."""
        from mokgen.runtime.workspace import saved_bytes

        rt = self._runtime
        held = rt.held_bytes() if rt is not None else 0
        return {"workspace": max(held, rt.call_bytes) if rt is not None else 0,
                "workspace_held": held, "layers_sharing": len(rt.layers) if rt else 0,
                "saved_per_call": saved_bytes(layer_spec(self.plan), self.plan.tokens_per_rank)}

    def __call__(self, x, router_logits, w1, w2, shared_w1=None, shared_w2=None, routes=None):
        """`routes=(experts [n, k], weights [n, k])` (lists of them for virtual ranks) replaces
        mokgen's routing by the caller's; then router_logits must be None. Differentiable:
        with autograd on and an input that requires grad, the backward megakernel computes
        the gradients of x, router_logits (or the route weights), w1, w2 and the shared
        weights."""
        many = self.virtual
        xs, zs, w1s, w2s, given = self._checked(x, router_logits, w1, w2, shared_w1, shared_w2,
                                                routes)
        leaves = [*xs, *(zs if given is None else [w for _, w in given]), *w1s, *w2s,
                  shared_w1, shared_w2]
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in leaves):
            experts = None if given is None else [e for e, _ in given]
            ys = _MoEFunction.apply(self, experts, len(xs), *leaves)
        else:
            ys = self.forward_raw(xs, zs, w1s, w2s, shared_w1, shared_w2, given)[0]
        return list(ys) if many else ys[0]

    def _checked(self, x, router_logits, w1, w2, shared_w1, shared_w2, routes):
        from mokgen.runtime.checks import check_inputs, check_routes

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
        return list(xs), zs, list(w1s), list(w2s), given

    def forward_raw(self, xs, zs, w1s, w2s, shared_w1, shared_w2, given=None, save=False):
        """Checked per-rank lists in, (ys, routes, generation, kept) out: the routes of each
        hosted rank's tokens, the runtime's generation and, keep_h plans, each rank's kept
        activations (KeptActivations; else None) are what backward_raw needs (save=True keeps
        the pre-activations for it)."""
        rt = self.runtime()
        rt.check()  # an earlier call's watchdog record, if any (no device sync)
        n = xs[0].shape[0]
        kept = rt.new_kept(n) if save and self.plan.keep_h else None
        ys = rt.forward(xs, zs, w1s, w2s, shared_w1, shared_w2, routes=given, save=save,
                        kept=kept)
        if not save:
            if self.releases_workspace:
                rt.release()
            return ys, None, rt.generation, None
        routes = given if given is not None else [rt.routes_of(i, n) for i in range(len(xs))]
        return ys, routes, rt.generation, kept

    def router_backward(self, logits, experts, dweights):
        """The router logits' gradient ([n, E] fp32) of a call mokgen routed, from its
        routes' experts and the backward's dweights [n, k] (one kernel)."""
        return self.runtime().router_backward(logits, experts, dweights)

    def backward_raw(self, dys, xs, w1s, w2s, shared_w1, shared_w2, routes, generation,
                     accumulate=None, kept=None):
        """(dxs, dweights [n, k] fp32, dw1s, dw2s, dshared_w1, dshared_w2) of a forward_raw
        call with save=True; per-rank lists like it. `routes` may be a caller's own (int64
        experts, bf16 weights): the kernels read int32 and fp32 when they re-schedule, as
        the forward's check_routes gave them. `accumulate`: per rank (dw1, dw2) to add the
        expert weight gradients into (BackwardPass.backward)."""
        bwd = self.backward_runtime()
        bwd.rt.check()
        dys = [dy.to(torch.bfloat16).contiguous() for dy in dys]
        routes = [(e.int().contiguous(), w.float().contiguous()) for e, w in routes]
        grads = bwd.backward(dys, xs, w1s, w2s, shared_w1, shared_w2, routes, generation,
                             accumulate, kept)
        if self.releases_workspace:  # what it returns is the caller's (copies, new outputs)
            bwd.rt.release()
        return grads

    def synchronize(self) -> None:
        """Wait for this layer's work and raise what the watchdog recorded, if anything."""
        torch.cuda.synchronize()
        self.runtime().check()


class _MoEFunction(torch.autograd.Function):
    """Autograd over the megakernels. Inputs: the layer, the caller's experts per rank (None:
    mokgen routes from logits), R, then the flat leaves xs[R], logits or route weights[R],
    w1s[R], w2s[R], shared_w1, shared_w2. Saves the inputs, the routes and, keep_h plans, the
    call's kept activations; the other activations stay in the layer's ring (see
    runtime/moe_bwd.py). The kept tensors are saved tensors, not attributes of ctx, so that
    activation checkpointing (torch.utils.checkpoint, use_reentrant=False) frees them with
    the forward and hands the backward those of its re-run forward, as it does the inputs."""

    @staticmethod
    def forward(ctx, layer, experts, R, *leaves):
        xs, zs, w1s, w2s = (list(leaves[i * R:(i + 1) * R]) for i in range(4))
        sw1, sw2 = leaves[4 * R:]
        given = None if experts is None else list(zip(experts, zs))
        ys, routes, gen, kept = layer.forward_raw(xs, None if given else zs, w1s, w2s, sw1,
                                                  sw2, given, save=True)
        ctx.layer, ctx.R, ctx.routes, ctx.generation = layer, R, routes, gen
        ctx.by_logits = experts is None
        # after the leaves, each hosted rank's kept tensors in turn (ops._kept_of splits them)
        kept = [t for k in kept for t in k.tensors()] if kept is not None else []
        ctx.n_kept = len(kept)
        ctx.save_for_backward(*leaves, *kept)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        from mokgen.pytorch.ops import _kept_of
        from mokgen.runtime.workspace import KeptActivations

        R = ctx.R
        leaves, kept = _kept_of(ctx, list(ctx.saved_tensors))
        per = len(kept) // R  # the R hosted ranks keep alike
        kept = [KeptActivations.of(kept[i * per:(i + 1) * per]) for i in range(R)] \
            if kept else None
        xs, zs, w1s, w2s = (list(leaves[i * R:(i + 1) * R]) for i in range(4))
        sw1, sw2 = leaves[4 * R:]
        dys = [torch.zeros_like(x) if d is None else d for d, x in zip(dys, xs)]
        dxs, dws, dw1s, dw2s, dsw1, dsw2 = ctx.layer.backward_raw(
            dys, xs, w1s, w2s, sw1, sw2, ctx.routes, ctx.generation, kept=kept)
        if ctx.by_logits:  # through the renormalized softmax top-k weights
            dzs = [ctx.layer.router_backward(z, e, dw).to(z.dtype)
                   for z, (e, _), dw in zip(zs, ctx.routes, dws)]
        else:
            dzs = [dw.to(z.dtype) for z, dw in zip(zs, dws)]
        return (None, None, None, *[d.to(x.dtype) for d, x in zip(dxs, xs)], *dzs, *dw1s,
                *dw2s, dsw1, dsw2)


def memory_report(plan: Plan, device_memory: int | None = None) -> dict:
    """Device bytes the plan's layers use beyond their weights, per rank, before any GPU:
    the workspace (paid once per device, group and plan, shared by every layer of the plan;
    by part), what one differentiable call keeps per layer for its backward, whether the
    backward needs its fp32 weight-gradient sums (a ring smaller than the worst case), and
    what an fp8 / MXFP8 layer holds besides (`quantized_weights_per_layer`: its quantized
    weights in the forward's layout, from a step's forward to its optimizer step; a backward
    makes a transposed copy of `quantized_transposed` bytes besides, which it frees unless
    the step accumulates gradients). Then the card: `gpu` (the plan's), its `device_memory`
    (given, else the current device's where it is the plan's GPU, else the kind's datasheet
    size) and `max_layers`, the most mokgen.MoE layers of this plan whose training step fits
    it (stack_memory: weights, gradients, quantized weights, workspace and what each layer
    keeps, no activation checkpointing)."""
    from mokgen.runtime.weight_quant import quantized_weight_bytes
    from mokgen.runtime.workspace import saved_bytes, workspace_bytes

    spec = layer_spec(plan)
    memory = device_memory or card_memory(plan)
    quantized = quantized_weight_bytes(spec)
    return {"workspace": workspace_bytes(spec),
            "saved_per_layer": saved_bytes(spec, plan.tokens_per_rank),
            "quantized_weights_per_layer": quantized["forward"],
            "quantized_transposed": quantized["transposed"],
            "wg_acc": spec.needs_wg_acc, "gpu": plan.gpu, "device_memory": memory,
            "max_layers": max_layers(plan, memory)}


def card_memory(plan: Plan) -> int:
    """Bytes of memory of the GPU `plan` is for: the current device's own total where it is
    that GPU (kind and SMs), else the kind's (hardware.py)."""
    from mokgen.compiler import hardware

    here = hardware.current() if torch.cuda.is_available() else None
    if here is not None and (here.name, here.num_sms) == (plan.gpu, plan.gpu_sms):
        return here.memory
    return plan.target.memory


# The share of a card's memory a training step may count on: the CUDA context, cuBLAS's
# workspaces and the caching allocator's rounding and fragmentation take the rest (an 80 GB
# H100 shows about 78 GiB free to torch). An estimate: benchmarks/model_stack.py checks it.
USABLE = 0.94


def layer_param_bytes(plan: Plan, router: bool = True) -> int:
    """Bytes of one mokgen.MoE layer's parameters on this rank: the local experts' w1 and w2
    and the shared expert's weights in bf16 (fp8 plans too: they quantize bf16 masters), the
    router's fp32 weight [E, D] (router=True, the module's default)."""
    s = plan.shape
    experts = plan.local_experts * 3 * s.intermediate * s.hidden * 2
    shared = 3 * s.shared_dim * s.hidden * 2 if s.shared_experts else 0
    return experts + shared + (s.num_experts * s.hidden * 4 if router else 0)


def stack_memory(plan: Plan, layers: int, checkpointing: bool = False, fused: bool = True,
                 router: bool = True, extra_saved_per_layer: int = 0,
                 tokens: int | None = None) -> dict:
    """Predicted device bytes of a training step of `layers` mokgen.MoE layers of `plan`, on
    one rank, by part, at its peak (the last layer's backward, every layer's saved
    activations still held): `weights` and `grads` (layer_param_bytes each), `fp8_weights`
    (fp8 plans: each layer's quantized forward copy, quantized_weight_bytes), `workspace`
    (once), `saved` (what each layer keeps for its backward: saved_bytes, and the router's
    fp32 input; with `checkpointing` only each layer's input, but the one layer whose
    forward re-ran), `transient` (one layer's backward: dx, the routing gradients, fp8's
    transposed weights (one step of one micro-batch: accumulating steps keep every layer's)
    and, not `fused`, autograd's temporary the size of the expert gradients) and `total`.
    `extra_saved_per_layer`: what the model keeps per layer besides the MoE (a pre-norm
    block: its norm's input, tokens x hidden x 2). `tokens`: per call (the plan's).
    benchmarks/model_stack.py prints it beside the measured peak: total less weights and
    gradients comes within 7% under the measured held + peak (Qwen3-30B-A3B, 8 to 48 layers,
    checkpointed or not)."""
    from mokgen.runtime.weight_quant import quantized_weight_bytes
    from mokgen.runtime.workspace import saved_bytes, workspace_bytes

    spec, s = layer_spec(plan), plan.shape
    n = tokens or plan.tokens_per_rank
    params = layer_param_bytes(plan, router)
    routed = plan.local_experts * 3 * s.intermediate * s.hidden
    per_layer = saved_bytes(spec, n) + (n * s.hidden * 4 if router else 0) \
        + extra_saved_per_layer
    kept_input = n * s.hidden * 2  # checkpointed: the block's input alone
    saved = per_layer + (layers - 1) * (kept_input if checkpointing else per_layer)
    # dy in; dx of the experts, of the router's path (fp32, then bf16) and their sum; the
    # logits' and route weights' gradients (fp32); autograd's expert-gradient temporary
    quantized = quantized_weight_bytes(spec)
    transient = n * s.hidden * 2 * 3 + n * (s.num_experts + s.topk) * 4 \
        + (n * s.hidden * (4 + 2) if router else 0) + (0 if fused else routed * 2) \
        + quantized["transposed"]
    parts = {"weights": layers * params, "grads": layers * params,
             "fp8_weights": layers * quantized["forward"],
             "workspace": workspace_bytes(spec)["total"], "saved": saved,
             "transient": transient}
    parts["total"] = sum(parts.values())
    return parts


def max_layers(plan: Plan, memory: int | None = None, **kw) -> int:
    """The most layers of `plan` whose training step (stack_memory, with `kw`) fits USABLE of
    `memory` bytes (default: the plan's card, card_memory); 0 if not even one."""
    budget = USABLE * (memory or card_memory(plan))
    one = stack_memory(plan, 1, **kw)["total"]
    if one > budget:
        return 0
    step = stack_memory(plan, 2, **kw)["total"] - one  # each layer more adds as much
    return 1 + int((budget - one) // step)


def format_memory(report: dict) -> str:
    mb = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    ws = report["workspace"]
    parts = ", ".join(f"{k} {mb(v)}" for k, v in ws.items() if k != "total")
    card = (f"; {report['gpu']} ({report['device_memory'] / 2**30:,.0f} GiB) trains "
            f"{report['max_layers']} such layers at most") if "max_layers" in report else ""
    quantized = report.get("quantized_weights_per_layer")
    held = f"; quantized weights held per layer {mb(quantized)}" if quantized else ""
    return (f"memory per rank: workspace {mb(ws['total'])} once per model ({parts}; "
            f"fp32 weight-gradient sums {'included' if report['wg_acc'] else 'not needed'}); "
            f"saved per layer call {mb(report['saved_per_layer'])}{held}{card}")


def build_plans(plans: list[Plan], jobs: int | None = None) -> list[build.Binary]:
    """Every distinct kernel of `plans` built, or found in the cache ($MOKGEN_CACHE), nvcc in
    `jobs` processes (build.build's default): what compile_layer builds, for many layers at
    once and without a GPU, so a device call finds them built (the benchmarks' --prebuild)."""
    archs = {p.arch for p in plans}
    if len(archs) > 1:
        raise ValueError(f"plans for several GPU architectures: {sorted(archs)}")
    kernels = {k.name: k for p in plans for k in codegen.emit(p)}
    arch = {"arch": archs.pop()} if archs else {}  # none: build.build's default
    return build.build(list(kernels.values()), jobs=jobs, **arch)


def compile_layer(plan: Plan, virtual: bool = False, group=None,
                  watchdog_s: float | None = None) -> CompiledMoE:
    if watchdog_s is not None and not watchdog_s > 0:
        raise ValueError(f"watchdog_s must be a positive number of seconds, got {watchdog_s!r}")
    t0 = time.perf_counter()
    bins = {b.name.split("_")[0]: b for b in build_plans([plan])}  # prologue, fwd, bwd
    return CompiledMoE(plan, bins, virtual, time.perf_counter() - t0, group, watchdog_s)
