"""Every communication direction on the GPU (marked gpu: skipped without one), forward and
backward: virtual ranks side by side (push dispatch, pull combine, push reverse-combine and
pull reverse-dispatch wait on peers inside the megakernel, so the R ranks' kernels run at
once, each on its share of the SMs: reserve_sms), against the reference, bitwise equal across
directions (the same fixed-order sums), and bitwise over repeated calls. Real ranks:
test_multigpu.py."""
import pytest
import torch

import mokgen
from mokgen.harness.workloads import (BACKWARD_DIRECTIONS, FORWARD_DIRECTIONS,
                              backward_direction_layers, cosine, direction_layers, make_inputs,
                              reference_grads, reference_outputs, rel_error)

pytestmark = pytest.mark.gpu
FORWARD = FORWARD_DIRECTIONS  # (dispatch, combine), the paper's first
EP = 2


def layer_kwargs(shape, tokens, sms: int, **pinned) -> dict:
    """(dispatch, combine) -> mokgen.compile's arguments: the ep virtual ranks' megakernels
    fit the GPU's `sms` at once (reserve_sms), every other decision pinned (workloads.
    direction_layers). No GPU needed: benchmarks/prebuild.py collect / build builds them."""
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


def autograd_grads(layer, inputs, dys):
    """y and every input's gradient through autograd, from fresh leaves: (ys, {name: [per
    rank]})."""
    leaves = {k: [t.detach().clone().requires_grad_() for t in v] if isinstance(v, list)
              else v.detach().clone().requires_grad_() for k, v in inputs.items()
              if v is not None}
    ys = layer(**leaves)
    torch.autograd.backward(ys, dys)
    torch.cuda.synchronize()
    return ys, {k: [t.grad for t in v] if isinstance(v, list) else [v.grad]
                for k, v in leaves.items()}


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
        _, g = autograd_grads(layer, inputs, dys)
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


# --- the backward's directions ---------------------------------------------------------------
BACKWARD = BACKWARD_DIRECTIONS  # (reverse_combine, reverse_dispatch), the paper's first
# (tokens, pinned, skew) of every backward layer the tests below compile: one minibatch per
# ring slot and none wrapping (the ring holds the forward: no replay), a ring that wraps (the
# owners wait on the expert's freed dy slots and staging slots, cross-GPU; replay), skewed
# routing (almost every token's first route on expert 0 of rank 0: "one-soft", whose router
# and other experts' gradients are not ~0 as "one"'s are), an odd token count, mxfp8 (no push
# reverse-combine)
BWD_CASES = {"bwd-plain": (600, {}, None), "bwd-ring-wraps": (600, dict(minibatch=128,
                                                                          macrobatch=256), None),
             "bwd-skew-one": (600, dict(minibatch=128, macrobatch=256), "one-soft"),
             "bwd-odd-tokens": (555, {}, None),
             "bwd-mxfp8": (600, dict(minibatch=128, macrobatch=256, dtype="mxfp8"), None)}


def backward_layer_kwargs(shape, tokens, sms: int, **pinned) -> dict:
    """(reverse_combine, reverse_dispatch) -> mokgen.compile's arguments, side by side as
    layer_kwargs (workloads.backward_direction_layers)."""
    return backward_direction_layers(shape, EP, tokens, reserve_sms=sms - sms // EP, **pinned)


def grads_poisoned(layer, inputs, dys):
    """autograd_grads, every output and scratch buffer of both megakernels poisoned first
    (an element a direction forgets to move shows as NaN)."""
    layer.runtime().poison()
    layer.backward_runtime().poison()
    out = autograd_grads(layer, inputs, dys)
    layer.runtime().check()
    return out


@pytest.mark.parametrize("case", list(BWD_CASES))
def test_every_backward_direction_matches_the_reference_and_each_other_bitwise(case):
    shape = mokgen.shapes.get("gpu-small")
    tokens, pinned, skew = BWD_CASES[case]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kws = backward_layer_kwargs(shape, tokens, sms, **pinned)
    fp8 = pinned.get("dtype")
    assert set(kws) == set(BACKWARD) - ({("push", "push"), ("push", "pull")} if fp8 else set())
    inputs = make_inputs(shape, EP, tokens, skew=skew)
    dys = [torch.randn_like(x) for x in inputs["x"]]
    ref = reference_grads(shape, inputs, dys, fp8=fp8)
    cos_min, rel_max = (0.996, 6e-2) if fp8 else (0.9999, 2e-2)
    got = {}
    for rr, kw in kws.items():
        layer = mokgen.compile(shape, virtual=True, **kw)
        assert (layer.plan.reverse_combine, layer.plan.reverse_dispatch) == rr
        ys, g = grads_poisoned(layer, inputs, dys)
        bad = []
        for k in ("x", "router_logits", "w1", "w2", "shared_w1", "shared_w2"):
            if k not in g or ref[k] is None:
                continue
            want = ref[k] if isinstance(ref[k], list) else [ref[k]]
            mine = g[k] if isinstance(ref[k], list) else [sum(t.float() for t in g[k])]
            for r, (a, w) in enumerate(zip(mine, want)):
                if a is None or not torch.isfinite(a).all():
                    bad.append(f"d{k}[{r}]: missing or not finite (unwritten rows?)")
                    continue
                c, e = cosine(a, w), rel_error(a, w)
                if not (c >= cos_min and e <= rel_max):
                    bad.append(f"d{k}[{r}]: cosine {c:.6f} rel {e:.3e}")
        assert not bad, f"{rr}: " + "; ".join(bad)
        _, again = grads_poisoned(layer, inputs, dys)
        for k in g:
            for a, b in zip(g[k], again[k]):
                assert torch.equal(a, b), f"{rr}: d{k} differs on a repeat"
        got[rr] = (ys, g)
        layer.synchronize()
    ys0, g0 = got[("pull", "push")]
    for rr, (ys, g) in got.items():
        assert all(torch.equal(a, b) for a, b in zip(ys0, ys)), f"{rr}: y differs bitwise"
        for k in g0:
            for r, (a, b) in enumerate(zip(g0[k], g[k])):
                assert torch.equal(a, b), f"{rr} rank {r}: d{k} differs bitwise from pull/push"


def test_backward_directions_after_every_forward_direction():
    """Both kernels moving rows the non-default way at once (one set of flags, schedule and
    staging rows serves both): the gradients are bitwise the paper's."""
    shape, tokens = mokgen.shapes.get("gpu-small"), 600
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    common = dict(reserve_sms=sms - sms // EP, minibatch=128, macrobatch=256)
    paper = backward_layer_kwargs(shape, tokens, sms, minibatch=128, macrobatch=256)
    inputs = make_inputs(shape, EP, tokens)
    dys = [torch.randn_like(x) for x in inputs["x"]]
    _, g0 = grads_poisoned(mokgen.compile(shape, virtual=True, **paper[("pull", "push")]),
                           inputs, dys)
    for (d, c), kw in direction_layers(shape, EP, tokens, **common).items():
        if (d, c) == ("pull", "push"):
            continue
        kw = dict(kw, comm_sms_bwd=paper[("pull", "push")]["comm_sms_bwd"],
                  reverse_combine="push", reverse_dispatch="pull")
        _, g = grads_poisoned(mokgen.compile(shape, virtual=True, **kw), inputs, dys)
        for k in g0:
            for r, (a, b) in enumerate(zip(g0[k], g[k])):
                assert torch.equal(a, b), f"{d}/{c} + push/pull rank {r}: d{k} differs bitwise"


def test_backward_directions_that_do_not_fit_side_by_side_are_refused():
    shape = mokgen.shapes.get("gpu-small")
    layer = mokgen.compile(shape, ep=EP, tokens_per_rank=128, virtual=True,
                           reverse_combine="push")
    inputs = make_inputs(shape, EP, 128)
    x = [t.detach().clone().requires_grad_() for t in inputs["x"]]
    ys = layer(**dict(inputs, x=x))  # the forward has the paper's directions: it runs
    with pytest.raises(ValueError, match="backward megakernels side by side.*reserve_sms"):
        torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])
