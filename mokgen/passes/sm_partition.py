"""Split the SMs between communication and compute, forward and backward separately.

Cost model per direction: comm time = bytes moved / min(link bandwidth, c * per-SM copy rate);
compute time = FLOPs / (rate * (S - c) / S). Overlapped, the layer takes the max of the two;
pick the c that minimizes it (smallest c on ties: compute SMs are the scarce ones)."""
from __future__ import annotations

from .. import hardware
from ..plan import Plan


def direction_costs(plan: Plan, backward: bool) -> tuple[float, float]:
    """(bytes each rank moves over the fabric, FLOPs each rank computes) for one call."""
    s, n = plan.shape, plan.tokens_per_rank
    rows = n * s.topk  # expected routed rows received per rank (uniform routing)
    routed_flops = 6 * rows * s.hidden * s.intermediate
    shared_flops = 6 * n * s.hidden * s.shared_dim
    # dispatch pulls rows in; combine pushes bf16 outputs back.
    moved = rows * plan.row_bytes + rows * 2 * s.hidden
    flops = routed_flops + shared_flops
    if backward:
        flops *= 2
        # reverse-combine pulls dy, reverse-dispatch pushes dx. The replay's re-pull of x is
        # left out: the ring is sized after this pass and usually holds every row. fp8 plans
        # pull x for every row (their forward's ring holds it in e4m3; the weight gradients
        # read bf16).
        moved = rows * 2 * s.hidden * (3 if plan.scale_block else 2)
    return moved, flops


def best_comm_sms(moved: float, flops: float, gpu: hardware.GPU, rate: float, ep: int) -> int:
    # On one rank (ep=1) rows are local copies over HBM, not NVLink.
    link = gpu.nvlink_bw if ep > 1 else gpu.hbm_bw / 2
    best = None
    for c in range(1, gpu.num_sms // 2 + 1):
        t_comm = moved / min(link, c * gpu.copy_bw_per_sm)
        t_comp = flops / (rate * (gpu.num_sms - c) / gpu.num_sms)
        t = max(t_comm, t_comp)
        if best is None or t < best[0] * (1 - 1e-9):
            best = (t, c)
    return best[1]


def sm_partition(plan: Plan) -> Plan:
    gpu = hardware.get(plan.gpu)
    rate = gpu.fp8_flops if plan.scale_block == 128 else gpu.bf16_flops
    out = {"num_sms": gpu.num_sms}
    for name, backward in (("comm_sms_fwd", False), ("comm_sms_bwd", True)):
        if not plan.is_forced(name):
            moved, flops = direction_costs(plan, backward)
            out[name] = best_comm_sms(moved, flops, gpu, rate, plan.ep)
    return plan.replace(**out)
