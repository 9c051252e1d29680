"""Argument checks of the compiled layer: clear errors naming the argument, before any launch."""
from __future__ import annotations

import torch


def _tensor(name, t, shape, dtypes, device=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_cuda or (device is not None and t.device != device):
        raise ValueError(f"{name} must be on {device or 'a CUDA device'}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_inputs(plan, xs, zs, w1s, w2s, shared_w1, shared_w2, many: bool):
    """Returns the router logits as fp32 contiguous tensors (what the routing kernel reads)."""
    s, R = plan.shape, plan.ep
    hosted = R if many else 1
    for name, v in (("x", xs), ("router_logits", zs), ("w1", w1s), ("w2", w2s)):
        if len(v) != hosted:
            raise ValueError(f"{name} must be a list of {hosted} tensors (one per virtual rank), "
                             f"got {len(v)}")
    n = xs[0].shape[0] if isinstance(xs[0], torch.Tensor) and xs[0].dim() == 2 else -1
    if not 0 < n <= plan.tokens_per_rank:
        raise ValueError(f"x must have 1..tokens_per_rank={plan.tokens_per_rank} rows, "
                         f"got shape {tuple(getattr(xs[0], 'shape', ()))}")
    dev = xs[0].device
    L, D, I = plan.local_experts, s.hidden, s.intermediate
    bf16 = (torch.bfloat16,)
    out = []
    for r in range(hosted):
        sfx = f"[{r}]" if many else ""
        _tensor(f"x{sfx}", xs[r], (n, D), bf16, dev)
        _tensor(f"router_logits{sfx}", zs[r], (n, s.num_experts),
                (torch.float32, torch.bfloat16, torch.float16), dev)
        _tensor(f"w1{sfx}", w1s[r], (L, 2 * I, D), bf16, dev)
        _tensor(f"w2{sfx}", w2s[r], (L, D, I), bf16, dev)
        out.append(zs[r].float().contiguous())
    if s.shared_experts:
        _tensor("shared_w1", shared_w1, (2 * s.shared_dim, D), bf16, dev)
        _tensor("shared_w2", shared_w2, (D, s.shared_dim), bf16, dev)
    elif shared_w1 is not None or shared_w2 is not None:
        raise ValueError("this shape has no shared expert: shared_w1 and shared_w2 must be None")
    return out
