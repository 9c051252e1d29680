"""Argument checks of the compiled layer: clear errors naming the argument, before any launch."""
from __future__ import annotations

import torch


def _tensor_meta(name, t, shape, dtypes):
    """Type, dtype, shape and layout: checks that need no GPU."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major), got strides {t.stride()}")


def _device(name, t, device):
    if not t.is_cuda or t.device != device:
        where = device if device.type == "cuda" else "a CUDA device"
        raise ValueError(f"{name} must be on {where}, got {t.device}")


def check_gpu(planned: str, sms: int, smem: int, device) -> None:
    """The device a layer is loaded on must be the GPU its plan was made for, in what the
    kernels are sized by: the SM count (one CTA an SM: the grids, the comm / compute split,
    the minibatch) and the shared memory a block may use. `planned` names the plan's GPU."""
    props = torch.cuda.get_device_properties(device)
    have_smem = getattr(props, "shared_memory_per_block_optin", 0) or smem
    if (props.multi_processor_count, have_smem) != (sms, smem):
        raise ValueError(
            f"mokgen: this layer was planned for {planned} ({sms} SMs, {smem // 1024} KiB "
            f"shared memory a block) but this GPU is {props.name} "
            f"({props.multi_processor_count} SMs, {have_smem // 1024} KiB): plan it for this "
            f"GPU (mokgen.compile / mokgen.MoE without gpu= plan for the device in hand)")


def check_ctas(kernel: str, ctas: int, device_sms: int) -> int:
    """A persistent kernel's CTA count, compiled in from the plan (the GPU's SMs less the
    reserve left to collectives), must fit this GPU: one CTA per SM, all resident at once."""
    if not 0 < ctas <= device_sms:
        raise ValueError(f"mokgen: the {kernel} kernel was planned for {ctas} CTAs (one per "
                         f"SM) but this GPU has {device_sms} SMs: plan it for this GPU, or "
                         f"leave SMs free with reserve_sms")
    return ctas


def check_inputs(plan, xs, zs, w1s, w2s, shared_w1, shared_w2, many: bool):
    """Every argument's type, dtype, shape and layout first, then devices, so a mistake is
    named precisely (and checkable without a GPU). Returns the router logits as fp32
    contiguous tensors (what the routing kernel reads)."""
    s, R = plan.shape, plan.ep
    hosted = R if many else 1
    for name, v in (("x", xs), ("router_logits", zs), ("w1", w1s), ("w2", w2s)):
        if not isinstance(v, (list, tuple)):
            raise TypeError(f"{name} must be a list of {hosted} tensors (one per virtual rank), "
                            f"got {type(v).__name__}")
        if len(v) != hosted:
            raise ValueError(f"{name} must be a list of {hosted} tensors (one per virtual rank), "
                             f"got {len(v)}")
    if not isinstance(xs[0], torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(xs[0]).__name__}")
    n = xs[0].shape[0] if xs[0].dim() == 2 else -1
    if not 0 < n <= plan.tokens_per_rank:
        raise ValueError(f"x must have 1..tokens_per_rank={plan.tokens_per_rank} rows, "
                         f"got shape {tuple(xs[0].shape)}")
    L, D, I = plan.local_experts, s.hidden, s.intermediate
    bf16 = (torch.bfloat16,)
    args = []
    for r in range(hosted):
        sfx = f"[{r}]" if many else ""
        args += [(f"x{sfx}", xs[r], (n, D), bf16),
                 (f"w1{sfx}", w1s[r], (L, 2 * I, D), bf16), (f"w2{sfx}", w2s[r], (L, D, I), bf16)]
        if zs[r] is not None:  # None: the caller gave routes instead (check_routes)
            args.append((f"router_logits{sfx}", zs[r], (n, s.num_experts),
                         (torch.float32, torch.bfloat16, torch.float16)))
    if s.shared_experts:
        args += [("shared_w1", shared_w1, (2 * s.shared_dim, D), bf16),
                 ("shared_w2", shared_w2, (D, s.shared_dim), bf16)]
    elif shared_w1 is not None or shared_w2 is not None:
        raise ValueError("this shape has no shared expert: shared_w1 and shared_w2 must be None")
    for a in args:
        _tensor_meta(*a)
    dev = xs[0].device
    for name, t, _, _ in args:
        _device(name, t, dev)
    return [None if z is None else z.float().contiguous() for z in zs]


def check_routes(plan, xs, routes, many: bool):
    """The caller's (experts, weights) per rank -> (int32, fp32) contiguous pairs."""
    hosted = plan.ep if many else 1
    if not isinstance(routes, (list, tuple)) or len(routes) != hosted:
        raise ValueError(f"routes must be {hosted} (experts, weights) pair(s), got {routes!r:.60}")
    n, k = (xs[0].shape[0] if isinstance(xs[0], torch.Tensor) else -1), plan.shape.topk
    out = []
    for r, pair in enumerate(routes):
        sfx = f"[{r}]" if many else ""
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise TypeError(f"routes{sfx} must be a pair (experts, weights)")
        experts, weights = pair
        _tensor_meta(f"routes{sfx}[0] (experts)", experts, (n, k), (torch.int64, torch.int32))
        if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
            raise TypeError(f"routes{sfx}[1] (weights) must be a floating-point tensor")
        _tensor_meta(f"routes{sfx}[1] (weights)", weights, (n, k), (weights.dtype,))
        _device(f"routes{sfx}[0] (experts)", experts, xs[0].device)
        _device(f"routes{sfx}[1] (weights)", weights, xs[0].device)
        out.append((experts.int().contiguous(), weights.float().contiguous()))
    return out
