"""The schedule's kernels alone (count, offsets, place: schedule.cuh) against mokgen.schedule,
bitwise: every intermediate buffer and the padded table, on random and skewed routes (marked
gpu: skipped without one)."""
import pytest
import torch

import mokgen
from mokgen.runtime import abi
from mokgen.schedule import chunk_ordinals, dispatch_schedule, weight_gradient_segments

pytestmark = pytest.mark.gpu

_RIGS = {}


def rig(E, k, ep, tokens):
    """One built prologue per layout (E, k, ep, tokens per rank), reused across cases."""
    from mokgen.harness.standalone import StandalonePrologue

    key = (E, k, ep, tokens)
    if key not in _RIGS:
        plan = mokgen.plan(mokgen.MoEShape(E, 256, 128, k), ep=ep, tokens_per_rank=tokens)
        _RIGS[key] = StandalonePrologue(plan)
    return _RIGS[key]


def make_routes(kind, R, n, k, E, g):
    """int64 [R, n*k] global experts, k distinct ones per token (the plan sizes the table
    for no more than that). random; hot: expert E // 2 (a middle rank's) in ~90% of the
    tokens; first: every token to experts 0..k-1 (expert 0 takes every token, the last
    ranks' experts none)."""
    if kind == "first":
        return torch.arange(k).repeat(R, n)
    z = torch.randn(R, n, E, generator=g)
    if kind == "hot":
        z[..., E // 2] += 3.0
    return z.topk(k, dim=-1).indices.reshape(R, n * k)


def check_rank(p, routes, weights, rank, n):
    s = p.spec
    L, R, TILE = s.local_experts, s.ep, s.block_m
    b = p.ranks[rank]
    for t in (b.ordinal, b.chunk_counts, b.counts, b.offsets, b.meta, b.table, b.row_weight):
        t.fill_(-7)  # poison: every element read below must be written by the kernels
    p.schedule(rank, n)
    torch.cuda.synchronize()
    ref = dispatch_schedule(routes, rank, L)
    r, j, inside, base = chunk_ordinals(routes, rank, L, abi.SCHED_CHUNK)
    C = base.shape[1]
    at = r * (n * s.topk) + j
    assert torch.equal(b.ordinal.cpu()[at].long(), inside), "ordinal inside the chunk"
    got_base = b.chunk_counts[: R * C * L].cpu().long().view(R, C, L)
    assert torch.equal(got_base, base), "chunk bases"
    counts = torch.bincount(r * L + (routes[r, j] - rank * L), minlength=R * L).view(R, L)
    assert torch.equal(b.counts.cpu().long().view(R, L), counts), "counts[r][l]"
    offsets = ref.padded_offsets(TILE)
    rows = int(offsets[-1])
    assert torch.equal(b.offsets.cpu().long(), offsets), "padded offsets"
    assert int(b.meta[0]) == rows, "padded row count"
    want = torch.full((rows, 2), -1, dtype=torch.long)
    pos = ref.padded_positions(TILE)
    want[pos] = ref.table
    assert torch.equal(b.table[:rows].cpu().long(), want), "table"
    w = weights[ref.table[:, 0], ref.table[:, 1]]
    assert torch.equal(b.row_weight[:rows].cpu()[pos], w), "row weights"


# (E, k, ep, tokens per rank): Qwen3-30B-A3B at ep 1 (64 chunks per rank: the offsets kernel
# splits each column among 8 thread groups) and ep 8; route counts that are no multiple of the
# chunk; 512 local experts (columns in 2 groups); 2 ranks' columns in 2 groups; as many
# columns as threads (1024 experts, the most routing takes); local expert counts that are no
# power of two; one route per rank
CASES = [(128, 8, 1, 8192), (128, 8, 8, 1000), (60, 4, 4, 777), (512, 10, 1, 1000),
         (64, 4, 2, 4000), (1024, 8, 1, 200), (1024, 32, 8, 100), (33, 32, 3, 256),
         (16, 1, 2, 1)]


@pytest.mark.parametrize("kind", ["random", "hot", "first"])
@pytest.mark.parametrize("E,k,ep,tokens", CASES)
def test_schedule_matches_reference_bitwise(E, k, ep, tokens, kind, rng):
    p = rig(E, k, ep, tokens)
    R = ep
    for n in sorted({tokens, max(0, tokens - 37)}):  # fewer tokens than planned too
        routes = make_routes(kind, R, n, k, E, rng)
        weights = torch.rand(R, n * k, generator=rng)
        p.set_routes(routes.cuda(), weights.cuda())
        for rank in sorted({0, R // 2, R - 1}):
            check_rank(p, routes, weights, rank, n)


def test_no_tokens_writes_an_empty_schedule():
    p = rig(128, 8, 8, 1000)
    for rank in (0, 7):
        check_rank(p, torch.zeros(8, 0, dtype=torch.long), torch.zeros(8, 0), rank, 0)


def test_schedule_is_deterministic(rng):
    p = rig(128, 8, 8, 1000)
    routes = make_routes("hot", 8, 1000, 8, 128, rng)
    p.set_routes(routes.cuda(), torch.rand(8, 8000, generator=rng).cuda())
    p.schedule(3, 1000)
    first = p.ranks[3].table.clone()
    for _ in range(3):
        p.schedule(3, 1000)
        assert torch.equal(p.ranks[3].table, first)


@pytest.mark.parametrize("E,k,ep,tokens", [(128, 8, 1, 8192), (60, 4, 4, 777), (512, 10, 1, 300)])
@pytest.mark.parametrize("kind", ["random", "hot"])
def test_segments_match_their_spec(E, k, ep, tokens, kind, rng):
    """The backward's weight-gradient segments from the schedule just built."""
    p = rig(E, k, ep, tokens)
    routes = make_routes(kind, ep, tokens, k, E, rng)
    p.set_routes(routes.cuda(), torch.rand(ep, tokens * k, generator=rng).cuda())
    p.schedule(0, tokens)
    p.bwd.segs.fill_(-7)
    p.bwd.seg_start.fill_(-7)
    p.segments(0)
    torch.cuda.synchronize()
    offsets = p.ranks[0].offsets.tolist()
    L = E // ep
    counts = torch.bincount((routes[routes // L == 0]).flatten(), minlength=L).tolist()
    assert counts == p.ranks[0].counts.view(ep, L).sum(0).tolist()
    segs, starts = weight_gradient_segments(offsets, counts, p.plan.minibatch,
                                            p.plan.ring_slots)
    assert p.bwd.seg_start[: len(starts)].tolist() == starts
    assert [tuple(s) for s in p.bwd.segs[: len(segs)].tolist()] == segs


# (E, k): E a multiple of 32 and not (lanes past E), one expert, the most routing takes
ROUTER_CASES = [(128, 8), (60, 4), (512, 10), (1, 1), (33, 32), (1024, 32)]


@pytest.mark.parametrize("E,k", ROUTER_CASES)
def test_router_backward_kernel_matches_the_reference(E, k, rng):
    """route.cuh router_backward_tokens (one launch) against mokgen.reference.router_backward
    on fresh random logits, routes mokgen picks and weight gradients: close (fp32, sums in
    another order), bitwise repeatable, every element written (poisoned first); a token with
    a NaN logit gets NaN gradients in its own row only, as the reference's."""
    from mokgen.reference import route, router_backward

    p = rig(E, k, 1, 64)
    n = 300
    z = torch.randn(n, E, generator=rng).cuda() * 3
    z[7, E // 2] = float("nan")
    experts, _ = route(z.cpu(), k)
    dw = torch.randn(n, k, generator=rng).cuda()
    e32 = experts.int().cuda()
    out = torch.full((n, E), float("nan"), device="cuda")
    p.kernels.router_backward(p.stream, z, e32, dw, out)
    again = torch.full((n, E), -3.0, device="cuda")
    p.kernels.router_backward(p.stream, z, e32, dw, again)
    torch.cuda.synchronize()
    want = router_backward(z.cpu(), experts, dw.cpu())
    ok = torch.ones(n, dtype=torch.bool)
    ok[7] = False
    assert torch.isnan(out[7]).all() and torch.isnan(again[7]).all() and \
        torch.isnan(want[7]).all()
    assert torch.equal(out[ok.cuda()], again[ok.cuda()]), "not bitwise repeatable"
    assert not torch.isnan(out[ok]).any(), "unwritten or NaN outside the NaN token's row"
    got = out.cpu()[ok]
    if E == 1:  # one expert: its weight is 1 whatever the logit, so no gradient at all
        assert not got.any() and not want[ok].any()
        return
    err = (got - want[ok]).norm() / want[ok].norm()
    assert err <= 1e-5, f"rel. error {err:.2e}"
    assert torch.allclose(got, want[ok], rtol=1e-4, atol=1e-6)
