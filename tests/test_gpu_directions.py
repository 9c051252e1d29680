"""Every forward communication direction on the GPU (marked gpu: skipped without one): virtual
ranks side by side (push dispatch and pull combine wait on peers inside the megakernel, so
the R ranks' kernels run at once, each on its share of the SMs: reserve_sms), against the
reference, bitwise equal across directions (the same fixed-order sums), and bitwise over
repeated calls. Real ranks: test_multigpu.py."""
import pytest
import torch

import mokgen
from mokgen.workloads import (FORWARD_DIRECTIONS, direction_layers, make_inputs,
                              reference_grads, reference_outputs, rel_error)

pytestmark = pytest.mark.gpu
FORWARD = FORWARD_DIRECTIONS  # (dispatch, combine), the paper's first
EP = 2


def layer_kwargs(shape, tokens, sms: int, **pinned) -> dict:
    """(dispatch, combine) -> mokgen.compile's arguments: the ep virtual ranks' megakernels
    fit the GPU's `sms` at once (reserve_sms), every other decision pinned (workloads.
    direction_layers). No GPU needed: benchmarks/directions.py --prebuild --tests builds them."""
    return direction_layers(shape, EP, tokens, reserve_sms=sms - sms // EP, **pinned)


# (tokens, pinned) of every layer the tests below compile
CASES = {"plain": (900, {}), "ring-wraps": (900, dict(minibatch=128, macrobatch=256)),
         "skew-one": (900, {}), "odd-tokens": (777, {}), "backward": (600, {})}


def compile_all(case):
    shape, (tokens, pinned) = mokgen.shapes.get("gpu-small"), CASES[case]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {dc: mokgen.compile(shape, virtual=True, **kw)
            for dc, kw in layer_kwargs(shape, tokens, sms, **pinned).items()}


def run_poisoned(layer, inputs):
    layer.runtime().poison()
    ys = layer(**inputs)
    torch.cuda.synchronize()
    layer.runtime().check()
    return ys


@pytest.mark.parametrize("case", ["plain", "ring-wraps", "skew-one", "odd-tokens"])
def test_every_direction_matches_the_reference_and_each_other_bitwise(case):
    shape, tokens = mokgen.shapes.get("gpu-small"), CASES[case][0]
    layers = compile_all(case)
    inputs = make_inputs(shape, EP, tokens, skew="one" if case == "skew-one" else None)
    ref = reference_outputs(shape, inputs)
    outs = {}
    for dc, layer in layers.items():
        ys = run_poisoned(layer, inputs)
        for r, (y, want) in enumerate(zip(ys, ref)):
            assert not y.isnan().any(), f"{dc} rank {r}: unwritten (NaN) output elements"
            assert rel_error(y, want) <= 1e-2, f"{dc} rank {r}: rel {rel_error(y, want):.3e}"
        again = layer(**inputs)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(ys, again)), f"{dc}: repeat differs"
        outs[dc] = ys
    paper = outs[("pull", "push")]
    for dc, ys in outs.items():
        for r, (a, b) in enumerate(zip(paper, ys)):
            assert torch.equal(a, b), f"{dc} rank {r} differs bitwise from pull/push"


def test_backward_after_every_forward_direction():
    """The backward reads the ring the forward filled (either way, the same rows): its
    gradients match the reference and are bitwise the same after every direction."""
    shape, tokens = mokgen.shapes.get("gpu-small"), CASES["backward"][0]
    layers = compile_all("backward")
    inputs = make_inputs(shape, EP, tokens)
    dys = [torch.randn_like(x) for x in inputs["x"]]
    ref = reference_grads(shape, inputs, dys)
    grads = {}
    for dc, layer in layers.items():
        leaves = {k: [t.detach().clone().requires_grad_() for t in v] if isinstance(v, list)
                  else v.detach().clone().requires_grad_() for k, v in inputs.items()
                  if v is not None}
        ys = layer(**leaves)
        torch.autograd.backward(ys, dys)
        torch.cuda.synchronize()
        g = {k: [t.grad for t in v] if isinstance(v, list) else [v.grad]
             for k, v in leaves.items()}
        for k in ("x", "w1", "w2"):
            for r in range(EP):
                e = rel_error(g[k][r], ref[k][r])
                assert e <= 2e-2, f"{dc} rank {r} d{k}: rel {e:.3e}"
        grads[dc] = g
    for dc, g in grads.items():
        for k in g:
            for a, b in zip(g[k], grads[("pull", "push")][k]):
                assert torch.equal(a, b), f"{dc} d{k} differs bitwise"


def test_virtual_ranks_that_do_not_fit_side_by_side_are_refused():
    shape = mokgen.shapes.get("gpu-small")
    layer = mokgen.compile(shape, ep=EP, tokens_per_rank=128, virtual=True, dispatch="push")
    with pytest.raises(ValueError, match="side by side.*reserve_sms"):
        layer(**make_inputs(shape, EP, 128))
