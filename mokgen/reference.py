"""Plain PyTorch MoE: the math contract every kernel is tested against (docs/design.md, "Math").

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

from mokgen.schedule import dispatch_schedule


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


def expert_ffn_quantized(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                         fmt: str) -> torch.Tensor:
    """The routed expert as the fp8 kernels compute it: x and w1 quantized along D (the gate/up
    GEMM's K; w1's gate and up rows blocked apart), the SwiGLU output and w2 along I (the down
    GEMM's K), fp32 products and sums of the dequantized operands (mokgen.quant.fake_quant;
    fmt "mxfp8" or "fp8")."""
    from mokgen.quant import fake_quant

    gate, up = (fake_quant(x, fmt) @ fake_quant(w1, fmt, weight=True, halves=-2).T).chunk(
        2, dim=-1)
    a = F.silu(gate) * up
    return fake_quant(a, fmt) @ fake_quant(w2, fmt, weight=True).T


def ffn_backward(x, w1, w2, dy, scale=None, fp8: str | None = None):
    """SwiGLU FFN backward without autograd. With a per-row `scale` (the router weight:
    out = scale * f(x)) it also returns d scale = <a, dy W2> per row, the SonicMoE form: the
    down projection's output is never needed. Returns (dx, dw1, dw2, dscale or None).
    `fp8` ("mxfp8" | "fp8"): the three activation-gradient GEMMs quantize their operands as the
    fp8 backward kernel does, each along its own K (the recomputed gate/up as the forward;
    dy and W2 along D; dh, rounded to bf16 first, and W1 along 2I, each of whose gate and up
    halves is blocked apart); the weight gradients stay in full precision."""
    from mokgen.quant import fake_quant

    fq = (lambda t, weight=False, halves=None: t) if fp8 is None else \
        (lambda t, weight=False, halves=None: fake_quant(t, fp8, weight, halves))
    gate, up = (fq(x) @ fq(w1, True, -2).T).chunk(2, dim=-1)
    sg = torch.sigmoid(gate)
    a = gate * sg * up
    da = fq(dy) @ fq(w2.T, True).T                 # down-projection input gradient
    dscale = None
    if scale is not None:
        dscale = (a * da).sum(-1)
        da = da * scale[:, None]
        dy = dy * scale[:, None]
    dw2 = dy.T @ a
    dh = torch.cat([da * up * sg * (1 + gate * (1 - sg)), da * gate * sg], dim=-1)
    if fp8 is not None:
        dh = dh.to(torch.bfloat16).to(dh.dtype)
    return fq(dh, halves=-1) @ fq(w1.T, True, -1).T, dh.T @ x, dw2, dscale



def router_backward(logits, experts, dweights):
    """Gradient of the logits from the gradient of the renormalized top-k weights."""
    s = torch.softmax(logits.float(), dim=-1)
    picked = s.gather(1, experts)
    total = picked.sum(-1, keepdim=True)
    w = picked / total
    ds_picked = (dweights - (dweights * w).sum(-1, keepdim=True)) / total
    ds = torch.zeros_like(s).scatter(1, experts, ds_picked)
    return s * (ds - (ds * s).sum(-1, keepdim=True))


def moe_backward(x, router_logits, w1, w2, shared_w1, shared_w2, topk: int, dy,
                 fp8: str | None = None):
    """Explicit backward of `moe_forward` (no autograd): grads of x, router_logits, w1, w2,
    shared_w1, shared_w2 (None for an absent shared expert). `fp8`: see ffn_backward."""
    experts, weights = route(router_logits, topk)
    dx, dweights, dw1, dw2, dsw1, dsw2 = moe_backward_routed(
        x, experts, weights, w1, w2, shared_w1, shared_w2, dy, fp8)
    dlogits = router_backward(router_logits, experts, dweights).to(router_logits.dtype)
    return dx, dlogits, dw1, dw2, dsw1, dsw2


def moe_backward_routed(x, experts, weights, w1, w2, shared_w1, shared_w2, dy,
                        fp8: str | None = None):
    """Explicit backward of `moe_forward_routed`: grads of x, weights (the router-weight
    gradient <a, dy W2>), w1, w2, shared_w1, shared_w2. `fp8`: the routed experts as the fp8
    backward computes them (ffn_backward); the shared expert stays bf16."""
    dx = torch.zeros_like(x)
    dw1, dw2 = torch.zeros_like(w1), torch.zeros_like(w2)
    dweights = torch.zeros_like(weights)
    for e in range(w1.shape[0]):
        tok, slot = (experts == e).nonzero(as_tuple=True)
        if len(tok):
            gx, dw1[e], dw2[e], dscale = ffn_backward(
                x[tok], w1[e], w2[e], dy[tok], weights[tok, slot].to(x.dtype), fp8)
            dx = dx.index_add(0, tok, gx)
            dweights[tok, slot] = dscale.to(dweights.dtype)
    dsw1 = dsw2 = None
    if shared_w1 is not None:
        gx, dsw1, dsw2, _ = ffn_backward(x, shared_w1, shared_w2, dy)
        dx = dx + gx
    return dx, dweights, dw1, dw2, dsw1, dsw2


def _shared(x, shared_w1, shared_w2):
    if shared_w1 is None:
        return torch.zeros_like(x)
    return expert_ffn(x, shared_w1, shared_w2)


def moe_forward(x, router_logits, w1, w2, shared_w1, shared_w2, topk: int,
                fp8: str | None = None) -> torch.Tensor:
    """One rank holding all experts: w1 [E, 2I, D], w2 [E, D, I]. Returns y [N, D]. `fp8`:
    see moe_forward_routed."""
    experts, weights = route(router_logits, topk)
    return moe_forward_routed(x, experts, weights, w1, w2, shared_w1, shared_w2, fp8)


def moe_forward_routed(x, experts, weights, w1, w2, shared_w1, shared_w2,
                       fp8: str | None = None) -> torch.Tensor:
    """The layer after routing: experts int [N, k] (global ids), weights [N, k] as given
    (a model's own router may score, normalize and scale them any way it likes). `fp8`
    ("mxfp8" | "fp8"): the routed experts quantize their operands as the fp8 kernels do
    (expert_ffn_quantized); the shared expert stays in the input precision."""
    y = _shared(x, shared_w1, shared_w2)
    routed = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        tok, slot = (experts == e).nonzero(as_tuple=True)
        if len(tok):
            f = expert_ffn(x[tok], w1[e], w2[e]) if fp8 is None else \
                expert_ffn_quantized(x[tok], w1[e], w2[e], fp8).to(x.dtype)
            out = f * weights[tok, slot, None].to(x.dtype)
            routed = routed.index_add(0, tok, out)
    return y + routed


def moe_forward_ep(xs, logits, w1s, w2s, shared_w1, shared_w2, topk: int,
                   compute_dtype=None, fp8: str | None = None) -> list:
    """R emulated ranks. xs[r] [N, D], logits[r] [N, E], w1s[r] [L, 2I, D] holding global
    experts r*L .. r*L+L-1, w2s[r] [L, D, I]; shared weights replicated. Returns [y_r].
    `compute_dtype` (e.g. float32 for bf16 inputs) upcasts one expert's weights at a time,
    so a GPU check of a large layer needs no fp32 copy of every weight. `fp8` ("mxfp8" |
    "fp8"): the routed experts quantize their operands as the fp8 kernels do."""
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
            out = expert_ffn(rows[lo:hi], up(w1s[c][l]), up(w2s[c][l])) if fp8 is None else \
                expert_ffn_quantized(rows[lo:hi], up(w1s[c][l]), up(w2s[c][l]), fp8)
            out = out * weights[src_r[lo:hi], src_j[lo:hi], None].to(out.dtype)
            combine = combine.index_add(0, src_r[lo:hi] * N * topk + src_j[lo:hi], out)
    combine = combine.view(R, N, topk, D)
    return [_shared(X[r], up(shared_w1), up(shared_w2)) + combine[r].sum(1)
            for r in range(R)]


class ReferenceMoE(torch.nn.Module):
    """Plain PyTorch MoE with every expert local, parameters named and laid out like
    mokgen.MoE's (router.weight, w1, w2, shared_w1, shared_w2): state dicts load both ways."""

    def __init__(self, shape, device=None, dtype=torch.float32):
        super().__init__()
        E, D, I = shape.num_experts, shape.hidden, shape.intermediate
        self.topk = shape.topk
        self.router = torch.nn.Linear(D, E, bias=False, device=device, dtype=dtype)
        self.w1 = torch.nn.Parameter(torch.zeros(E, 2 * I, D, device=device, dtype=dtype))
        self.w2 = torch.nn.Parameter(torch.zeros(E, D, I, device=device, dtype=dtype))
        self.shared_w1 = self.shared_w2 = None
        if shape.shared_experts:
            Is = shape.shared_dim
            self.shared_w1 = torch.nn.Parameter(torch.zeros(2 * Is, D, device=device, dtype=dtype))
            self.shared_w2 = torch.nn.Parameter(torch.zeros(D, Is, device=device, dtype=dtype))

    def forward(self, x):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        y = moe_forward(x2, self.router(x2).float(), self.w1, self.w2, self.shared_w1,
                        self.shared_w2, self.topk)
        return y.reshape(*lead, -1)
