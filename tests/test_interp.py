"""The interpreter (the kernels' executable spec) against the reference, forward and every
gradient, including ring wrap-around and backward replay."""
import pytest
import torch

import mokgen
from mokgen import reference as ref
from mokgen.interp import Interpreter


def make_inputs(shape, R, N, g, skew=False):
    E, D, I = shape.num_experts, shape.hidden, shape.intermediate
    xs = [torch.randn(N, D, generator=g) for _ in range(R)]
    zs = [torch.randn(N, E, generator=g) * 2 for _ in range(R)]
    if skew:  # every token prefers expert 0 (plus the next k-1): one expert takes all
        for z in zs:
            z[:, : shape.topk] += 20 + torch.arange(shape.topk, 0, -1.0)
    w1 = torch.randn(E, 2 * I, D, generator=g) / D**0.5
    w2 = torch.randn(E, D, I, generator=g) / I**0.5
    sw1 = sw2 = None
    if shape.shared_experts:
        sw1 = torch.randn(2 * shape.shared_dim, D, generator=g) / D**0.5
        sw2 = torch.randn(D, shape.shared_dim, generator=g) / shape.shared_dim**0.5
    return xs, zs, w1, w2, sw1, sw2


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def run_both(shape, R, N, g, skew=False, **overrides):
    xs, zs, w1, w2, sw1, sw2 = make_inputs(shape, R, N, g, skew)
    L = shape.num_experts // R
    plan = mokgen.plan(shape, ep=R, tokens_per_rank=N, **overrides)
    it = Interpreter(plan)
    w1s, w2s = list(w1.split(L)), list(w2.split(L))
    ys = it.forward(xs, zs, w1s, w2s, sw1, sw2)
    dys = [torch.randn(N, shape.hidden, generator=g) for _ in range(R)]
    grads = it.backward(dys, zs, w1s, w2s, xs, sw1, sw2)

    leaves = [t.clone().requires_grad_() for t in (w1, w2)]
    sh = [t.clone().requires_grad_() if t is not None else None for t in (sw1, sw2)]
    xr = [x.clone().requires_grad_() for x in xs]
    zr = [z.clone().requires_grad_() for z in zs]
    yr = [ref.moe_forward(xr[r], zr[r], *leaves, *sh, shape.topk) for r in range(R)]
    torch.autograd.backward(yr, dys)
    for r in range(R):
        assert rel(ys[r], yr[r]) <= 1e-5
        assert rel(grads["dx"][r], xr[r].grad) <= 1e-5
        if shape.topk > 1:
            assert rel(grads["dlogits"][r], zr[r].grad) <= 1e-5
        else:  # one route's weight is 1 whatever the logits: their gradient is rounding only
            assert max(grads["dlogits"][r].abs().max(), zr[r].grad.abs().max()) <= 1e-4
    assert rel(torch.cat(grads["dw1"]), leaves[0].grad) <= 1e-5
    assert rel(torch.cat(grads["dw2"]), leaves[1].grad) <= 1e-5
    if sw1 is not None:
        assert rel(grads["dshared_w1"], sh[0].grad) <= 1e-5
        assert rel(grads["dshared_w2"], sh[1].grad) <= 1e-5
    return it


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_matches_reference_with_ring_wrap_and_replay(R, rng):
    shape = mokgen.shapes.get("small")
    # 40 tokens * 4 routes per rank, tiles of 128 rows: a 256-row ring cannot hold them
    it = run_both(shape, R, 100, rng, minibatch=128, macrobatch=256)
    st = max(it.states, key=lambda s: s.rows)
    assert st.rows > it.M, "test must make the ring wrap"
    kinds = [k for k, _ in st.log]
    assert "resident" in kinds and kinds.count("pull") > it.minibatches(st.rows), \
        "backward must both reuse the ring and replay what it lost"


@pytest.mark.parametrize("R", [1, 4])
def test_matches_reference_without_wrap(R, rng):
    it = run_both(mokgen.shapes.get("tiny"), R, 30, rng)
    st = it.states[0]
    assert st.rows <= it.M and all(k != "pull" for k, m in st.log[len(st.log) // 2:])


def test_skewed_routing_and_no_shared_expert(rng):
    it = run_both(mokgen.shapes.get("small-noshared"), 4, 33, rng, skew=True,
                  minibatch=128, macrobatch=256)
    assert it.states[0].rows >= 4 * 33  # rank 0 got every token of every rank


def test_forward_order_is_reverse_macrobatch():
    plan = mokgen.plan(mokgen.shapes.get("tiny"), ep=1, tokens_per_rank=10,
                       minibatch=128, macrobatch=256)
    it = Interpreter(plan)
    assert it.forward_order(128 * 5) == [4, 2, 3, 0, 1]
    assert it.backward_order(128 * 5) == [0, 1, 2, 3, 4]


def test_single_rank_reference_matches_ep_reference(rng):
    shape = mokgen.shapes.get("small")
    R, N = 4, 12
    xs, zs, w1, w2, sw1, sw2 = make_inputs(shape, R, N, rng)
    L = shape.num_experts // R
    ys = ref.moe_forward_ep(xs, zs, list(w1.split(L)), list(w2.split(L)), sw1, sw2, shape.topk)
    for r in range(R):
        assert rel(ys[r], ref.moe_forward(xs[r], zs[r], w1, w2, sw1, sw2, shape.topk)) <= 1e-5


def test_route_ties_pick_lower_expert():
    experts, weights = ref.route(torch.zeros(3, 8), 2)
    assert experts.tolist() == [[0, 1]] * 3
    assert torch.allclose(weights, torch.full((3, 2), 0.5))


def test_explicit_reference_backward_matches_autograd(rng):
    shape = mokgen.shapes.get("small")
    xs, zs, w1, w2, sw1, sw2 = make_inputs(shape, 1, 50, rng)
    x, z = xs[0].clone().requires_grad_(), zs[0].clone().requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (w1, w2, sw1, sw2)]
    dy = torch.randn(50, shape.hidden, generator=rng)
    ref.moe_forward(x, z, *leaves, shape.topk).backward(dy)
    got = ref.moe_backward(xs[0], zs[0], w1, w2, sw1, sw2, shape.topk, dy)
    for g, want in zip(got, [x.grad, z.grad] + [t.grad for t in leaves]):
        assert rel(g, want) <= 1e-5


@pytest.mark.parametrize("dims", [(256, 128), (256 + 16, 128 + 16)])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_fp8_plan_matches_the_quantized_reference(fmt, dims, rng):
    """fp8 plans: the forward multiplies the operands as mokgen.quant quantizes them (the
    reference's quantized layer, to fp32 summation order), with the ring wrapping; so does
    the backward, reusing the ring's last macrobatch and replaying the rest. Widths 16 past
    whole blocks too (partial scale blocks, zero-padded; W1's and dh's gate / up halves
    blocked apart)."""
    shape = mokgen.MoEShape(8, *dims, 2, name="fp8-tiny")
    R, n = 2, 100
    plan = mokgen.plan(shape, ep=R, dtype=fmt, tokens_per_rank=n, minibatch=128, macrobatch=256)
    it = Interpreter(plan)
    g = rng
    E, D, I, L = shape.num_experts, shape.hidden, shape.intermediate, shape.num_experts // R
    xs = [torch.randn(n, D, generator=g) for _ in range(R)]
    zs = [torch.randn(n, E, generator=g) for _ in range(R)]
    w1s = [torch.randn(L, 2 * I, D, generator=g) / D**0.5 for _ in range(R)]
    w2s = [torch.randn(L, D, I, generator=g) / I**0.5 for _ in range(R)]
    sw1, sw2 = torch.randn(2 * 128, D, generator=g) / D**0.5, torch.randn(D, 128, generator=g) / 128**0.5
    ys = it.forward(xs, zs, w1s, w2s, sw1, sw2)
    assert max(s.rows for s in it.states) > it.M, "the ring must wrap"
    want = ref.moe_forward_ep(xs, zs, w1s, w2s, sw1, sw2, shape.topk, fp8=fmt)
    exact = ref.moe_forward_ep(xs, zs, w1s, w2s, sw1, sw2, shape.topk)
    for y, w, e in zip(ys, want, exact):
        assert rel(y, w) <= 5e-3          # e4m3 roundings may flip with the sum order
        assert 5e-3 < rel(y, e) <= 6e-2   # and the quantization is really there
    dys = [torch.randn(n, D, generator=g) for _ in range(R)]
    grads = it.backward(dys, zs, w1s, w2s, xs, sw1, sw2)
    st = max(it.states, key=lambda s: s.rows)  # the ring's last macrobatch is reused
    kinds = [k for k, _ in st.log]
    assert "resident" in kinds and kinds.count("pull") > it.minibatches(st.rows)
    W1, W2 = torch.cat(w1s), torch.cat(w2s)
    want = [ref.moe_backward(xs[r], zs[r], W1, W2, sw1, sw2, shape.topk, dys[r], fp8=fmt)
            for r in range(R)]
    exact = [ref.moe_backward(xs[r], zs[r], W1, W2, sw1, sw2, shape.topk, dys[r])
             for r in range(R)]
    for r in range(R):
        assert rel(grads["dx"][r], want[r][0]) <= 5e-3
        assert rel(grads["dlogits"][r], want[r][1]) <= 5e-3
        assert 5e-3 < rel(grads["dx"][r], exact[r][0]) <= 6e-2  # quantized, really
    for j, name in ((2, "dw1"), (3, "dw2")):
        assert rel(torch.cat(grads[name]), sum(w[j] for w in want)) <= 5e-3, name
