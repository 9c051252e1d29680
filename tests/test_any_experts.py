"""Expert counts that are not multiples of 32 and top-k from 1 to 32, on CPU: route.cuh's warp
selection as a lane-by-lane torch model against the reference's routing, and the interpreter
(the kernels' spec) against the reference with local expert counts like 15 and 5."""
import pytest
import torch

import mokgen
from mokgen.reference import route
from test_interp import run_both

INT_MAX = 2**31 - 1


def warp_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """route.cuh's selection, one row per token: lane l holds experts l + 32 i (i < E/32
    rounded up; -inf past E), takes its best not-yet-picked (value desc, id asc) and the warp
    reduces over xor-shuffles with the same order. NaN ranks as +inf."""
    n, e = logits.shape
    per_lane = (e + 31) // 32
    ids = torch.arange(32 * per_lane).view(per_lane, 32).T  # [lane, i] -> expert
    z = torch.full((n, 32 * per_lane), -torch.inf)
    z[:, :e] = torch.nan_to_num(logits.float(), nan=torch.inf, posinf=torch.inf,
                                neginf=-torch.inf)
    z = z[:, ids]                                            # [n, lane, i]
    valid = (ids < e).expand(n, 32, per_lane)
    taken = torch.zeros(n, 32, per_lane, dtype=torch.bool)
    picked = []
    for _ in range(k):
        best = torch.full((n, 32), -torch.inf)
        best_e = torch.full((n, 32), INT_MAX)
        for i in range(per_lane):  # the lane's own loop, in the kernel's order
            v, ei = z[:, :, i], ids[:, i].expand(n, 32)
            ok = valid[:, :, i] & ~taken[:, :, i] & ((v > best) | ((v == best) & (ei < best_e)))
            best, best_e = torch.where(ok, v, best), torch.where(ok, ei, best_e)
        for o in (16, 8, 4, 2, 1):  # __shfl_xor_sync butterfly
            partner = torch.arange(32) ^ o
            ob, oe = best[:, partner], best_e[:, partner]
            ok = (ob > best) | ((ob == best) & (oe < best_e))
            best, best_e = torch.where(ok, ob, best), torch.where(ok, oe, best_e)
        assert (best_e == best_e[:, :1]).all(), "every lane must agree after the reduction"
        picked.append(best_e[:, 0])
        taken |= ids.expand(n, 32, per_lane) == best_e[:, :1, None]
    return torch.stack(picked, 1)


@pytest.mark.parametrize("e", [1, 5, 8, 31, 33, 40, 60, 100, 384, 1000, 1024])
@pytest.mark.parametrize("k", [1, 4, 8, 32])
def test_warp_selection_matches_reference_routing(e, k, rng):
    if k > e:
        pytest.skip("topk > num_experts is refused by MoEShape")
    n = 64
    random = torch.randn(n, e, generator=rng) * 2
    ties = torch.randint(-2, 3, (n, e), generator=rng).float()  # many equal logits
    for logits in (random, ties):
        assert torch.equal(warp_topk(logits, k), route(logits, k)[0]), "selection differs"
    # -inf logits (masked experts) are still picked, lowest id first, once the rest are gone
    masked = random.clone()
    masked[:, 1::2] = -torch.inf
    got = warp_topk(masked, k)
    assert (got.sort(1).values.diff(1) > 0).all(), "an expert picked twice"
    assert torch.equal(got, route(masked, k)[0])


def test_lanes_past_the_last_expert_are_never_picked():
    z = torch.full((3, 60), -torch.inf)  # every real expert at -inf, padding lanes too
    assert warp_topk(z, 8).tolist() == [list(range(8))] * 3


@pytest.mark.parametrize("e,k,R", [(60, 1, 4), (60, 4, 5), (60, 8, 1), (40, 1, 5), (40, 4, 1),
                                   (40, 8, 8)])
def test_interpreter_matches_reference_for_odd_expert_counts(e, k, R, rng):
    """60 experts (with a shared expert) over 4 ranks are 15 local experts, over 5 are 12;
    40 (without) over 5 are 8 and over 8 are 5, fewer than k = 8: a rank then gets at most 5
    of a token's routes. The ring wraps."""
    shape = mokgen.MoEShape(e, 256, 128, k, shared_experts=int(e == 60))
    it = run_both(shape, R, 40, rng, minibatch=128, macrobatch=256)
    L = e // R
    assert it.plan.max_routed_rows >= R * 40 * min(k, L) and it.plan.local_experts == L
    assert max(s.rows for s in it.states) > it.M or R * k <= 4
