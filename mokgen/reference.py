"""Plain PyTorch MoE: the math contract every kernel is tested against (design.md, "Math").

- `route`: softmax scores in fp32, top-k (ties: lower expert id first), weights renormalized
  over the selected experts. Differentiable in the logits.
- `moe_forward`: one rank holding all experts; its backward is autograd's.
- `moe_forward_ep`: R ranks emulated as lists of per-rank tensors, tokens moved with the
  Algorithm-1 schedule exactly like the distributed layer, so it must agree with the single-
  rank form. Also the shape of the NCCL + PyTorch multi-GPU baseline.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .schedule import dispatch_schedule


def route(router_logits: torch.Tensor, topk: int):
    """-> (experts int64 [N, k], weights [N, k] fp32). Stable sort: ties pick the lower id."""
    scores = torch.softmax(router_logits.float(), dim=-1)
    experts = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
    picked = scores.gather(1, experts)
    return experts, picked / picked.sum(-1, keepdim=True)


def expert_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU FFN with nn.Linear weights: w1 [2I, D] (gate rows, then up rows), w2 [D, I]."""
    gate, up = (x @ w1.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.T


def _shared(x, shared_w1, shared_w2):
    if shared_w1 is None:
        return torch.zeros_like(x)
    return expert_ffn(x, shared_w1, shared_w2)


def moe_forward(x, router_logits, w1, w2, shared_w1, shared_w2, topk: int) -> torch.Tensor:
    """One rank holding every expert: w1 [E, 2I, D], w2 [E, D, I]. Returns y [N, D]."""
    experts, weights = route(router_logits, topk)
    y = _shared(x, shared_w1, shared_w2)
    routed = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        tok, slot = (experts == e).nonzero(as_tuple=True)
        if len(tok):
            out = expert_ffn(x[tok], w1[e], w2[e]) * weights[tok, slot, None].to(x.dtype)
            routed = routed.index_add(0, tok, out)
    return y + routed


def moe_forward_ep(xs, logits, w1s, w2s, shared_w1, shared_w2, topk: int,
                   compute_dtype=None) -> list:
    """R emulated ranks. xs[r] [N, D], logits[r] [N, E], w1s[r] [L, 2I, D] holding global
    experts r*L .. r*L+L-1, w2s[r] [L, D, I]; shared weights replicated. Returns [y_r].
    `compute_dtype` (e.g. float32 for bf16 inputs) upcasts one expert's weights at a time,
    so a GPU check of a large layer needs no fp32 copy of every weight."""
    cd = compute_dtype or xs[0].dtype
    up = lambda t: None if t is None else t.to(cd)  # noqa: E731
    R = len(xs)
    L = w1s[0].shape[0]
    N, D = xs[0].shape
    routed = [route(z, topk) for z in logits]
    routes = torch.stack([e.flatten() for e, _ in routed])        # all-gather [R, N*k]
    weights = torch.stack([w.flatten() for _, w in routed])       # [R, N*k]
    X = torch.stack(xs).to(cd)                                    # peers' x, [R, N, D]
    # Owner-side combine buffers, flattened: route j of rank r lands at row r*N*k + j.
    combine = X.new_zeros(R * N * topk, D)
    for c in range(R):
        sched = dispatch_schedule(routes, c, L)
        src_r, src_j = sched.table[:, 0], sched.table[:, 1]
        rows = X[src_r, src_j // topk]                            # pull dispatch
        for l in range(L):
            lo, hi = sched.offsets[l].item(), sched.offsets[l + 1].item()
            if lo == hi:
                continue
            out = expert_ffn(rows[lo:hi], up(w1s[c][l]), up(w2s[c][l]))
            out = out * weights[src_r[lo:hi], src_j[lo:hi], None].to(out.dtype)
            combine = combine.index_add(0, src_r[lo:hi] * N * topk + src_j[lo:hi], out)
    combine = combine.view(R, N, topk, D)
    return [_shared(X[r], up(shared_w1), up(shared_w2)) + combine[r].sum(1)
            for r in range(R)]
