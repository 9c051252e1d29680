"""A forward and its backward through ForwardRuntime and BackwardPass, as the compiled layer
calls them, on the CPU with the driver stood in for (tests/dry_driver.py): the host paths of
the plan kinds whose host side differs (kept h, replay, fp8, MXFP8, virtual ranks) run to
their launches. Every tensor map asked for lies inside its tensor, and every kernel argument
struct packs its fields. The kernels' results: the GPU suite (test_gpu_forward,
test_gpu_backward, test_gpu_fp8)."""
import pytest
import torch
from dry_driver import DryDriver

import mokgen
from mokgen.compiler.lower import layer_spec

SHAPE = mokgen.shapes.get("gpu-small")
CASES = {
    "bf16, ep 1": dict(ep=1),
    "bf16, ep 1, replay": dict(ep=1, keep_h=False),
    "fp8, ep 1": dict(ep=1, dtype="fp8"),
    "mxfp8, ep 1": dict(ep=1, dtype="mxfp8"),
    "bf16, 4 virtual ranks": dict(ep=4),
    "fp8, 4 virtual ranks": dict(ep=4, dtype="fp8"),
}


def weights(rt, g):
    """Per hosted rank w1 and w2, and the shared expert's (None without one), bf16."""
    L, D, I, S = rt.spec.local_experts, SHAPE.hidden, SHAPE.intermediate, SHAPE.shared_dim
    bf16 = lambda *shape: torch.randn(*shape, generator=g).bfloat16()  # noqa: E731
    hosted = range(rt.hosted)
    return ([bf16(L, 2 * I, D) for _ in hosted], [bf16(L, D, I) for _ in hosted],
            *((bf16(2 * S, D), bf16(D, S)) if S else (None, None)))


def step(rt, bwd, n, seed=0, ws=None):
    """One forward with save and its backward on fresh random inputs (routes by logits), on
    `ws` (weights()) or new weights; -> (the backward's outputs, the weights)."""
    g = torch.Generator().manual_seed(seed)
    hosted = range(rt.hosted)
    xs = [torch.randn(n, SHAPE.hidden, generator=g).bfloat16() for _ in hosted]
    zs = [torch.randn(n, SHAPE.num_experts, generator=g) for _ in hosted]
    w1s, w2s, sw1, sw2 = ws = ws or weights(rt, g)
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
