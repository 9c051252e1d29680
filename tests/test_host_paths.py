"""A forward and its backward through ForwardRuntime and BackwardPass, as the compiled layer
calls them, on the CPU with the driver stood in for (tests/dry_driver.py): the host paths of
the plan kinds whose host side differs (kept h, replay, gathered rows, fp8, MXFP8, virtual
ranks) run to their launches. Every tensor map asked for lies inside its tensor, and every
kernel argument struct packs its fields. Then the layer above them (mokgen.MoE's one-rank layer: its
workspace between calls). The kernels' results: the GPU suite (test_gpu_forward,
test_gpu_backward, test_gpu_fp8, test_gpu_memory)."""
import functools
import itertools
from types import SimpleNamespace

import pytest
import torch
from dry_driver import DryDriver

import mokgen
from mokgen.compiler.lower import layer_spec

SHAPE = mokgen.shapes.get("gpu-small")
CASES = {
    "bf16, ep 1": dict(ep=1),
    "bf16, ep 1, replay": dict(ep=1, keep_h=False),
    "bf16, ep 1, gathered rows": dict(ep=1, dispatch="gather", reverse_combine="gather",
                                      reverse_dispatch="push", comm_sms_bwd=0),
    "fp8, ep 1": dict(ep=1, dtype="fp8"),
    "mxfp8, ep 1": dict(ep=1, dtype="mxfp8"),
    "bf16, 4 virtual ranks": dict(ep=4),
    "fp8, 4 virtual ranks": dict(ep=4, dtype="fp8"),
}


def weights(local_experts, ranks, g):
    """Per hosted rank w1 and w2, and the shared expert's (None without one), bf16."""
    L, D, I, S = local_experts, SHAPE.hidden, SHAPE.intermediate, SHAPE.shared_dim
    bf16 = lambda *shape: torch.randn(*shape, generator=g).bfloat16()  # noqa: E731
    hosted = range(ranks)
    return ([bf16(L, 2 * I, D) for _ in hosted], [bf16(L, D, I) for _ in hosted],
            *((bf16(2 * S, D), bf16(D, S)) if S else (None, None)))


def step(rt, bwd, n, seed=0, ws=None):
    """One forward with save and its backward on fresh random inputs (routes by logits), on
    `ws` (weights()) or new weights; -> (the backward's outputs, the weights)."""
    g = torch.Generator().manual_seed(seed)
    hosted = range(rt.hosted)
    xs = [torch.randn(n, SHAPE.hidden, generator=g).bfloat16() for _ in hosted]
    zs = [torch.randn(n, SHAPE.num_experts, generator=g) for _ in hosted]
    w1s, w2s, sw1, sw2 = ws = ws or weights(rt.spec.local_experts, rt.hosted, g)
    kept = rt.new_kept(n) if rt.spec.keep_h else None
    ys = rt.forward(xs, zs, w1s, w2s, sw1, sw2, save=True, kept=kept)
    routes = [rt.routes_of(i, n) for i in hosted]
    dys = [torch.randn(y.shape, generator=g).bfloat16() for y in ys]
    return bwd.backward(dys, xs, w1s, w2s, sw1, sw2, routes, rt.generation, kept=kept), ws


@pytest.mark.parametrize("case", list(CASES))
def test_a_training_step_runs_its_host_side_to_every_launch(monkeypatch, case):
    plan = mokgen.plan(SHAPE, tokens_per_rank=256, **CASES[case])
    drv = DryDriver(monkeypatch, layer_spec(plan))
    rt, bwd = drv.runtimes()
    (dxs, dweights, dw1s, dw2s, dsw1, dsw2), _ = step(rt, bwd, 200)
    R = rt.hosted
    assert drv.launches.count("mokgen_fwd") == R and drv.launches.count("mokgen_bwd") == R
    assert drv.launches.index("mokgen_fwd") < drv.launches.index("mokgen_bwd")
    if plan.dtype != "bf16":
        assert drv.launches.count("mokgen_quant_x") == R  # the tokens, by their owner
    assert [tuple(d.shape) for d in dxs] == [(200, SHAPE.hidden)] * R
    assert [tuple(d.shape) for d in dweights] == [(200, SHAPE.topk)] * R
    assert len(dw1s) == len(dw2s) == R and (dsw1 is None) == (SHAPE.shared_dim == 0)
    assert rt.stats["backward"] == 1


def test_fp8_backward_frees_its_transposed_weights_once_then_keeps_them(monkeypatch):
    """The first backward on a weight version frees its transposed copy (one layer's at a
    time in a stack), the second (gradient accumulation) keeps it, through the real
    BackwardPass._launch (MXFP8's copy goes the same way: test_quant's WeightCache tests)."""
    plan = mokgen.plan(SHAPE, ep=1, tokens_per_rank=256, dtype="fp8")
    drv = DryDriver(monkeypatch, layer_spec(plan))
    rt, bwd = drv.runtimes()
    _, ws = step(rt, bwd, 128)
    (entry,) = rt.weights._cache.values()
    assert entry.backwards == 1 and not hasattr(entry, "t")
    step(rt, bwd, 128, seed=1, ws=ws)  # the next micro-batch, the same weights
    assert rt.weights._cache[next(iter(rt.weights._cache))] is entry
    assert entry.backwards == 2 and hasattr(entry, "t")


_LAYERS = itertools.count()  # a fresh kernels key a layer: no workspace pooled across tests


def dry_compile(monkeypatch, plan) -> DryDriver:
    """compile_layer returns a CompiledMoE of stand-in binaries whose runtimes are
    DryDriver's, on CPU buffers: the layer-level host paths (autograd, release) run as on
    the GPU."""
    from mokgen.pytorch import api
    from mokgen.runtime import checks, moe

    drv = DryDriver(monkeypatch, layer_spec(plan))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(checks, "check_gpu", lambda *args: None)
    # the arguments' device check, less "on CUDA": every argument on x's device (the CPU)
    monkeypatch.setattr(checks, "_device", lambda name, t, device: None if t.device == device
                        else pytest.fail(f"{name} on {t.device}, x on {device}"))
    monkeypatch.setattr(moe, "ForwardRuntime", functools.partial(moe.ForwardRuntime,
                                                                 device=torch.device("cpu")))
    tag = next(_LAYERS)
    units = ("prologue", "fwd", "bwd") + (("bwdres",) if plan.keep_h else ())
    binaries = {u: SimpleNamespace(image=u.encode(), key=f"{u}-{tag}") for u in units}
    monkeypatch.setattr(api, "compile_layer", lambda plan, virtual=False, group=None,
                        watchdog_s=None: api.CompiledMoE(plan, binaries, virtual, 0, group))
    return drv


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_the_modules_one_rank_layer_holds_its_workspace_only_inside_calls(monkeypatch, dtype):
    """mokgen.MoE's kernels (_LazyKernels, this rank's tensors): a saving forward keeps the
    workspace for its backward, which returns it; a forward that saves nothing returns it at
    once (test_gpu_memory asserts the same on the GPU)."""
    from mokgen.pytorch.module import _LazyKernels

    plan = mokgen.plan(SHAPE, ep=1, tokens_per_rank=256, dtype=dtype)
    drv = dry_compile(monkeypatch, plan)
    kernels = _LazyKernels(plan, None)
    layer = kernels.layer()
    assert not layer.virtual and layer.releases_workspace
    g = torch.Generator().manual_seed(2)
    (w1,), (w2,), sw1, sw2 = weights(plan.local_experts, 1, g)
    x = torch.randn(100, SHAPE.hidden, generator=g).bfloat16()
    z = torch.randn(100, SHAPE.num_experts, generator=g)
    y, routes, generation, kept = kernels.forward(x, z, w1, w2, sw1, sw2, save=True)
    assert y.shape == x.shape and layer.memory()["workspace_held"] > 0
    dx, *_ = kernels.backward(torch.randn(y.shape, generator=g).bfloat16(), x, w1, w2, sw1,
                              sw2, routes, generation, kept=kept)
    assert dx.shape == x.shape
    held = layer.memory()
    assert held["workspace_held"] == 0 and held["workspace"] > 0
    kernels.forward(x, z, w1, w2, sw1, sw2, save=False)
    assert layer.memory()["workspace_held"] == 0
    assert drv.launches.count("mokgen_fwd") == 2 and drv.launches.count("mokgen_bwd") == 1


@pytest.mark.parametrize("ep,dtype", [(1, "bf16"), (1, "fp8"), (4, "bf16")])
def test_a_compiled_layers_autograd_step_runs_on_the_host(monkeypatch, ep, dtype):
    """mokgen.compile's layer under autograd (its _MoEFunction: save, backward_raw, the
    router's backward): one rank's tensors, or lists of them for virtual ranks; every leaf
    gets a gradient of its shape."""
    from mokgen.pytorch import api

    plan = mokgen.plan(SHAPE, ep=ep, tokens_per_rank=256, dtype=dtype)
    drv = dry_compile(monkeypatch, plan)
    layer = api.compile_layer(plan, virtual=ep > 1)
    g = torch.Generator().manual_seed(3)
    w1s, w2s, sw1, sw2 = weights(plan.local_experts, ep, g)
    xs = [torch.randn(90, SHAPE.hidden, generator=g).bfloat16() for _ in range(ep)]
    zs = [torch.randn(90, SHAPE.num_experts, generator=g) for _ in range(ep)]
    leaves = [t.requires_grad_() for t in (*xs, *zs, *w1s, *w2s)
              + ((sw1, sw2) if sw1 is not None else ())]
    one = (lambda v: v) if ep > 1 else (lambda v: v[0])  # noqa: E731
    ys = layer(one(xs), one(zs), one(w1s), one(w2s), sw1, sw2)
    sum(y.float().sum() for y in (ys if ep > 1 else [ys])).backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)
    assert drv.launches.count("mokgen_bwd") == ep and drv.launches.count("mokgen_router_bwd") == ep
    assert layer.memory()["workspace_held"] == (0 if ep == 1 else layer.memory()["workspace"])
