"""The NCCL + PyTorch EP baseline of benchmarks/multigpu.py, on CPU: R ranks as threads, the
all_to_all a list exchange between them. Forward and autograd backward against the reference
with every expert on one rank. (At R = 2 the benchmark's first version sent each row's expert
id offset by the *sender's* rank: bincount of negative ids on one rank, too many groups for
grouped_mm on the other.)"""
import threading

import pytest
import torch

import mokgen
from mokgen import reference
from mokgen.harness.ep_baseline import EPBaseline, dispatch_layout


class ListExchange:
    """all_to_all between R threads: each posts its splits, all wait, each takes its parts."""

    def __init__(self, R):
        self.R, self.box, self.barrier = R, {}, threading.Barrier(R)

    def for_rank(self, r):
        def exchange(t, out_splits, in_splits):
            assert sum(in_splits) == t.shape[0]
            self.box[r] = list(t.split(in_splits))
            self.barrier.wait()
            got = [self.box[src][r] for src in range(self.R)]
            assert [g.shape[0] for g in got] == list(out_splits)
            self.barrier.wait()  # nobody overwrites a box before every rank read it
            return torch.cat(got).clone()
        return exchange


def run_ranks(R, fn):
    out, errors = [None] * R, []

    def body(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            ex.barrier.abort()

    ex = ListExchange(R)
    fn.exchange = ex
    threads = [threading.Thread(target=body, args=(r,)) for r in range(R)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def test_dispatch_layout_ids_are_the_destinations():
    experts = torch.tensor([[5, 0], [2, 7], [6, 1]])  # L = 4: ranks 1,0 / 0,1 / 1,0
    order, send, local = dispatch_layout(experts, 2, 4)
    assert send.tolist() == [3, 3]
    assert experts.flatten()[order].tolist() == [0, 2, 1, 5, 7, 6]
    assert local.tolist() == [0, 2, 1, 1, 3, 2]  # never negative, always < L


@pytest.mark.parametrize("R,grouped,dtype", [(2, False, torch.float32), (3, False, torch.float32),
                                             (2, True, torch.bfloat16)])
def test_baseline_matches_the_reference_forward_and_backward(R, grouped, dtype):
    shape = mokgen.MoEShape(6 * R, 64, 32, 4)
    n, L, g = 29, 6, torch.Generator().manual_seed(7)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    xs, zs = [rn(n, 64) for _ in range(R)], [rn(n, 6 * R) for _ in range(R)]
    zs[0][:, 0] += 6.0  # a hot expert: rank 0 gets more rows than it sends
    w1s, w2s = [rn(L, 64, 64) / 8 for _ in range(R)], [rn(L, 64, 32) / 6 for _ in range(R)]
    sw1, sw2 = rn(64, 64) / 8, rn(64, 32) / 6
    dys = [rn(n, 64) for _ in range(R)]
    leaf = lambda t: t.to(dtype).clone().requires_grad_()  # noqa: E731

    def rank(r):
        p = {k: leaf(v) for k, v in dict(x=xs[r], z=zs[r], w1=w1s[r], w2=w2s[r]).items()}
        p["z"] = zs[r].clone().requires_grad_()  # logits stay fp32, as the layer takes them
        base = EPBaseline(shape, R, p["w1"], p["w2"], sw1.to(dtype), sw2.to(dtype),
                          rank.exchange.for_rank(r), grouped)
        y = base(p["x"], p["z"])
        y.backward(dys[r].to(dtype))
        return y.detach(), {k: v.grad for k, v in p.items()}

    got = run_ranks(R, rank)
    W1, W2 = torch.cat(w1s), torch.cat(w2s)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()  # noqa: E731
    dW1, dW2 = torch.zeros_like(W1), torch.zeros_like(W2)
    for r in range(R):
        x, z = xs[r].clone().requires_grad_(), zs[r].clone().requires_grad_()
        w1, w2 = W1.clone().requires_grad_(), W2.clone().requires_grad_()
        y = reference.moe_forward(x, z, w1, w2, sw1, sw2, shape.topk)
        y.backward(dys[r])
        dW1 += w1.grad
        dW2 += w2.grad
        assert rel(got[r][0], y.detach()) < tol, f"rank {r} y"
        assert rel(got[r][1]["x"], x.grad) < tol, f"rank {r} dx"
        assert rel(got[r][1]["z"], z.grad) < 10 * tol, f"rank {r} dlogits"
    # each rank's expert gradients see every rank's tokens routed to them
    for r in range(R):
        assert rel(got[r][1]["w1"], dW1[r * L:(r + 1) * L]) < tol, f"rank {r} dw1"
        assert rel(got[r][1]["w2"], dW2[r * L:(r + 1) * L]) < tol, f"rank {r} dw2"
