"""The expert-parallel layer users build from NCCL and PyTorch: the multi-GPU baseline of
benchmarks/multigpu.py.

One rank's call: route (softmax top-k), sort the k routes of every token by the rank that owns
their expert, all_to_all the row counts (the splits go to the host: one sync, as users do),
then the rows and each row's expert id *on its destination rank*, run the local experts
(torch._grouped_mm, or a per-expert loop), all_to_all the outputs back, and sum each token's
k outputs weighted by the router, plus the shared expert. The backward is autograd's: each
all_to_all of rows is differentiable, its backward the reverse exchange.

`exchange(t, out_splits, in_splits) -> tensor` is the one all_to_all (dim 0 split); it is
injected, so a CPU test runs R ranks as threads with a list exchange in its place, and the
benchmark passes NCCL's (`dist_exchange`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mokgen import reference


def dispatch_layout(experts: torch.Tensor, ranks: int, local_experts: int):
    """experts [n, k] global ids -> (order, send, local):
    order  [n*k] route indices (into experts.flatten()) sorted by destination rank, stable,
           so each destination gets its routes in token order;
    send   [ranks] routes (rows) sent to each rank;
    local  [n*k] each sorted route's expert id on its destination rank: global id % L.
    (At world size 1 `global id - this rank * L` is the same number; at R > 1 it is not: the
    offset is the destination's, not the sender's.)"""
    flat = experts.flatten()
    dest = torch.div(flat, local_experts, rounding_mode="floor")
    order = torch.argsort(dest, stable=True)
    return order, torch.bincount(dest, minlength=ranks), (flat % local_experts)[order]


class _Exchange(torch.autograd.Function):
    """A differentiable all_to_all of rows: the gradient goes back the reverse way."""

    @staticmethod
    def forward(ctx, t, out_splits, in_splits, exchange):
        ctx.splits, ctx.exchange = (out_splits, in_splits), exchange
        return exchange(t, out_splits, in_splits)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return ctx.exchange(g.contiguous(), in_splits, out_splits), None, None, None


def dist_exchange(group=None):
    """NCCL's all_to_all_single over `group` as an exchange."""
    import torch.distributed as dist

    def exchange(t, out_splits, in_splits):
        out = t.new_empty(sum(out_splits), *t.shape[1:])
        dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=group)
        return out
    return exchange


class EPBaseline:
    """One rank of the baseline; it holds global experts r*L .. r*L+L-1 as w1 [L, 2I, D],
    w2 [L, D, I] (leaves that may require grad) and the replicated shared expert."""

    def __init__(self, shape, ranks: int, w1, w2, shared_w1, shared_w2, exchange,
                 grouped: bool = True):
        self.k, self.R, self.L = shape.topk, ranks, shape.num_experts // ranks
        self.w1, self.w2, self.sw1, self.sw2 = w1, w2, shared_w1, shared_w2
        self.exchange, self.grouped = exchange, grouped

    def __call__(self, x, logits):
        n, D, k, R = x.shape[0], x.shape[1], self.k, self.R
        experts, weights = reference.route(logits, k)
        order, send, local = dispatch_layout(experts, R, self.L)
        recv = self.exchange(send, [1] * R, [1] * R)
        s_split, r_split = send.tolist(), recv.tolist()  # host sync: the splits
        rows = _Exchange.apply(x[order // k], r_split, s_split, self.exchange)
        eid = self.exchange(local, r_split, s_split)
        out = self.experts(rows, eid)
        back = _Exchange.apply(out, s_split, r_split, self.exchange)
        routed = torch.empty_like(back).index_copy(0, order, back)
        y = (routed.view(n, k, D) * weights.unsqueeze(-1).to(x.dtype)).sum(1)
        if self.sw1 is not None:
            y = y + reference.expert_ffn(x, self.sw1, self.sw2)
        return y

    def experts(self, rows, eid):
        """The local experts on the received rows (eid: local ids), in the received order."""
        perm = torch.argsort(eid, stable=True)
        srt = rows[perm]
        counts = torch.bincount(eid, minlength=self.L)
        if self.grouped:
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = torch._grouped_mm(srt, self.w1.transpose(1, 2), offs=offs)
            I = h.shape[1] // 2
            out = torch._grouped_mm(F.silu(h[:, :I]) * h[:, I:], self.w2.transpose(1, 2),
                                    offs=offs)
        else:
            parts, lo = [], 0
            for e, c in enumerate(counts.tolist()):  # host sync
                parts.append(reference.expert_ffn(srt[lo:lo + c], self.w1[e], self.w2[e]))
                lo += c
            out = torch.cat(parts)
        return torch.empty_like(out).index_copy(0, perm, out)
