"""Algorithm 1 against a brute-force sort."""
import pytest
import torch

from mokgen.schedule import dispatch_positions, dispatch_schedule


def brute_force(routes, rank, L):
    R, NK = routes.shape
    keyed = []
    for r in range(R):
        seen = {}
        for j in range(NK):
            e = int(routes[r, j])
            o = seen.get(e, 0)
            seen[e] = o + 1
            if rank * L <= e < rank * L + L:
                keyed.append(((e - rank * L, o, r), (r, j)))
    keyed.sort()
    return torch.tensor([rj for _, rj in keyed], dtype=torch.long).view(-1, 2)


def make_routes(kind, R, N, k, E, g):
    if kind == "random":  # k distinct experts per token
        return torch.stack([torch.rand(N, E, generator=g).argsort(-1)[:, :k].flatten()
                            for _ in range(R)])
    if kind == "skewed":  # every token to experts 0..k-1: expert 0 gets every token
        return torch.arange(k).repeat(R, N)
    if kind == "sparse":  # only even experts used: half the experts get nothing
        return torch.stack([(torch.rand(N, E // 2, generator=g).argsort(-1)[:, :k] * 2).flatten()
                            for _ in range(R)])
    raise ValueError(kind)


@pytest.mark.parametrize("R", [1, 2, 4, 8, 64])
@pytest.mark.parametrize("kind", ["random", "skewed", "sparse"])
def test_matches_brute_force(R, kind, rng):
    N, k = 24, 3
    L = 8 if R <= 8 else 2
    E = R * L
    routes = make_routes(kind, R, N, k, E, rng)
    for rank in sorted({0, R // 2, R - 1}):
        sched = dispatch_schedule(routes, rank, L)
        want = brute_force(routes, rank, L)
        assert torch.equal(sched.table, want)
        local = routes - rank * L
        counts = torch.stack([(local == l).sum() for l in range(L)])
        assert torch.equal(sched.counts, counts)
        assert sched.offsets[0] == 0 and sched.offsets[-1] == len(want)
        # the closed form of Algorithm 1 (what the GPU kernel computes) gives the same table
        r, j, p = dispatch_positions(routes, rank, L)
        table = torch.empty_like(want)
        table[p, 0], table[p, 1] = r, j
        assert torch.equal(table, want)


@pytest.mark.parametrize("R,L,k", [(1, 60, 8), (4, 15, 4), (8, 5, 8), (6, 10, 1), (3, 1, 1)])
def test_any_local_expert_count(R, L, k, rng):
    """Local expert counts that are not powers of two (Qwen1.5-MoE's 60 over 4 ranks is 15),
    and fewer local experts than routes per token."""
    routes = make_routes("random", R, 20, k, R * L, rng)
    for rank in sorted({0, R - 1}):
        want = brute_force(routes, rank, L)
        assert torch.equal(dispatch_schedule(routes, rank, L).table, want)
        r, j, p = dispatch_positions(routes, rank, L)
        table = torch.empty_like(want)
        table[p, 0], table[p, 1] = r, j
        assert torch.equal(table, want)


def test_skewed_all_on_one_expert(rng):
    R, N, k, L = 4, 16, 2, 2
    routes = make_routes("skewed", R, N, k, R * L, rng)
    sched = dispatch_schedule(routes, 0, L)
    assert sched.counts[0] == R * N  # every token of every rank
    # sources round-robin inside the region: ranks 0,1,2,3,0,1,...
    assert torch.equal(sched.table[: R * N, 0], torch.arange(R).repeat(N))


def test_sparse_has_empty_experts_and_padding(rng):
    R, N, k, E = 2, 20, 2, 8
    routes = make_routes("sparse", R, N, k, E, rng)
    sched = dispatch_schedule(routes, 1, 4)
    assert (sched.counts[1::2] == 0).all() and (sched.counts[0::2] > 0).all()
    poff = sched.padded_offsets(16)
    assert (poff % 16 == 0).all()
    pos = sched.padded_positions(16)
    assert len(set(pos.tolist())) == len(pos) and int(pos.max()) < int(poff[-1])


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="routes"):
        dispatch_schedule(torch.zeros(4, dtype=torch.float32), 0, 2)
    with pytest.raises(ValueError, match="rank"):
        dispatch_schedule(torch.zeros(2, 4, dtype=torch.long), 2, 2)


@pytest.mark.parametrize("chunk", [1, 7, 32, 1024])
@pytest.mark.parametrize("kind", ["random", "skewed", "sparse"])
def test_chunked_ordinals_add_up(chunk, kind, rng):
    """The GPU count kernel counts chunks of routes apart: a chunk's base plus the ordinal
    inside it is the route's ordinal, whatever the chunk size (one larger than the routes,
    one route each)."""
    from mokgen.schedule import _local_routes, _ordinals, chunk_ordinals

    R, N, k, L = 4, 50, 3, 4
    routes = make_routes(kind, R, N, k, R * L, rng)
    for rank in (0, R - 1):
        r, j, inside, base = chunk_ordinals(routes, rank, L, chunk)
        src_rank, src_index, expert = _local_routes(routes, rank, L)
        assert torch.equal(r, src_rank) and torch.equal(j, src_index)
        assert base.shape == (R, max(1, -(-N * k // chunk)), L)
        assert torch.equal(base[r, j // chunk, expert] + inside, _ordinals(r * L + expert))
        assert (inside < chunk).all()


@pytest.mark.parametrize("kind", ["random", "hot", "sparse"])
@pytest.mark.parametrize("L,B", [(8, 128), (48, 256), (3, 64)])
def test_weight_gradient_sums_get_slots_of_their_own(kind, L, B, rng):
    """The backward keeps an fp32 running sum only for an expert whose rows span several
    minibatches; indexed by the minibatch its rows start in (wg_acc_slot), every such expert
    has a slot of its own, the same for all its segments, below max_minibatches - 1:
    LayerSpec.wg_acc_slots of them suffice."""
    from mokgen.runtime.workspace import LayerSpec
    from mokgen.schedule import wg_acc_slot, weight_gradient_segments

    for _ in range(20):
        counts = torch.randint(0, 3 * B, (L,), generator=rng)
        if kind == "hot":
            counts[torch.randint(0, L, (1,), generator=rng)] += 7 * B
        elif kind == "sparse":
            counts[::2] = 0
        padded = (counts + 63) // 64 * 64  # block_m regions, as the schedule pads them
        offsets = [0] + torch.cumsum(padded, 0).tolist()
        segs, _ = weight_gradient_segments(offsets, counts.tolist(), B, slots=2)
        nm = -(-offsets[-1] // B)
        spec = LayerSpec(num_experts=L, hidden=128, intermediate=128, shared_dim=0, topk=1,
                         ep=1, tokens_per_rank=offsets[-1], block_m=64, minibatch=B,
                         macrobatch=2 * B, comm_sms=1, max_rows=max(offsets[-1], 1))
        owner = {}
        for s in segs:
            if s[3] >> 16 < 2:  # one segment: written directly, no sum
                continue
            slot = wg_acc_slot(s, B, spec.wg_by_minibatch)
            assert 0 <= slot < spec.wg_acc_slots, (s, slot, spec.wg_acc_slots)
            assert owner.setdefault(slot, s[0]) == s[0], f"slot {slot}: experts {owner[slot]}, {s[0]}"
        assert len(owner) <= max(nm - 1, 0)


@pytest.mark.parametrize("B,slots", [(256, 64), (256, 2), (128, 3)])
def test_weight_gradient_segments_end_at_each_experts_last_row(B, slots, rng):
    """The weight gradients' K stops at an expert's last row, not at its tile-padded
    region's end (schedule.cuh schedule_segments): the last segment of every expert with rows
    ends at offsets[e] + counts[e], in the minibatch its region ends in, and the segments of
    an expert cover its rows once, in order."""
    from mokgen.schedule import weight_gradient_segments

    for _ in range(20):
        counts = torch.randint(0, 3 * B, (12,), generator=rng)
        counts[::5] = 0
        padded = (counts + 127) // 128 * 128
        offsets = [0] + torch.cumsum(padded, 0).tolist()
        segs, _ = weight_gradient_segments(offsets, counts.tolist(), B, slots)
        for e, c in enumerate(counts.tolist()):
            mine = [s for s in segs if s[0] == e]
            if c == 0:
                assert mine == [(e, 0, 0, 1 << 16)]
                continue
            assert mine[0][1] == offsets[e] and mine[-1][2] == offsets[e] + c
            assert (mine[-1][2] - 1) // B == (offsets[e + 1] - 1) // B
            assert all(a[2] == b[1] for a, b in zip(mine, mine[1:]))


def test_wg_acc_shrinks_to_the_minibatch_boundaries():
    """kimi-k2.7's ep8 load as the directions ablation plans it (48 local experts, 16k rows in
    minibatches of 1408): 11 running sums instead of 48."""
    from mokgen.runtime.workspace import LayerSpec

    s = LayerSpec(num_experts=96, hidden=7168, intermediate=2048, shared_dim=2048, topk=8,
                  ep=2, tokens_per_rank=2048, block_m=128, minibatch=1408, macrobatch=2816,
                  comm_sms=6, max_rows=16384 + 48 * 127)
    assert s.needs_wg_acc and s.wg_by_minibatch and s.wg_acc_slots == s.max_minibatches - 1 < 48
    few = LayerSpec(num_experts=8, hidden=6144, intermediate=16384, shared_dim=0, topk=2,
                    ep=8, tokens_per_rank=4096, block_m=128, minibatch=640, macrobatch=1280,
                    comm_sms=1, max_rows=8320)
    assert few.needs_wg_acc and not few.wg_by_minibatch and few.wg_acc_slots == 1
