"""Minibatch size b from the paper's model (3.2): P_fine(b) + P_coarse(b), with
P_fine = ceil(rows / b) * C_ineff(b) and P_coarse = T_dispatch(b) + T_combine(b).

C_ineff(b) is what one minibatch wastes: a flag hand-off, plus the tensor-core time lost to
the last partial wave of its gate/up and down tiles over the compute SMs. Candidates are
multiples of the GEMM tile; the smallest b wins ties (less exposed latency)."""
from __future__ import annotations

import math

from .. import hardware, ir
from ..plan import Plan

# Output columns per tile in the model. The kernels' tiles are BN = plan.gemm_fwd.bn = 256 wide
# (the rows, plan.block_m, are theirs): counting their tiles moves the minibatch of most
# default plans, so that waits for a GPU benchmark of the plans it picks (issue #18).
MODEL_TILE_N = 128


def minibatch_cost(plan: Plan, b: int, gpu: hardware.GPU, link: float | None = None) -> float:
    """`link`: the fabric's bytes/s (default: NVLink; one rank: HBM copies)."""
    s = plan.shape
    rows = plan.tokens_per_rank * s.topk
    compute_sms = plan.num_sms - plan.comm_sms_fwd  # num_sms: CTAs, after any reserve
    rate = (gpu.fp8_flops if plan.scale_block == 128 else gpu.bf16_flops) / gpu.num_sms
    waste = gpu.flag_latency
    # (tiles, FLOPs per tile) of the gate/up GEMM and the down GEMM of one minibatch
    for tiles, k in (((b // plan.block_m) * (2 * s.intermediate // MODEL_TILE_N), s.hidden),
                     ((b // plan.block_m) * math.ceil(s.hidden / MODEL_TILE_N), s.intermediate)):
        tile_time = 2 * plan.block_m * MODEL_TILE_N * k / rate
        waves = tiles / compute_sms
        waste += (math.ceil(waves) - waves) * tile_time
    if link is None:
        link = gpu.nvlink_bw if plan.ep > 1 else gpu.hbm_bw / 2
    if plan.comm_sms_fwd:
        bw = min(link, plan.comm_sms_fwd * gpu.copy_bw_per_sm)
        t_dispatch = b * plan.row_bytes / bw
        t_combine = b * 2 * s.hidden / bw
    else:  # gathered rows (sm_partition.gathers): nothing is copied in or out by comm CTAs;
        # what a minibatch exposes is the last one's down GEMM, which nothing overlaps
        t_dispatch = 0.0
        t_combine = 2 * b * s.hidden * s.intermediate / (rate * compute_sms)
    return math.ceil(rows / b) * waste + t_dispatch + t_combine


def candidates(plan: Plan) -> list[int]:
    rows = plan.tokens_per_rank * plan.shape.topk
    top = max(plan.block_m, -(-rows // plan.block_m) * plan.block_m)
    sizes = range(plan.block_m, top + 1, plan.block_m)
    if plan.is_forced("macrobatch"):  # a forced ring must hold >= 2 whole minibatches
        sizes = [b for b in sizes if plan.macrobatch % b == 0 and plan.macrobatch >= 2 * b]
        sizes = sizes or [plan.block_m]
    return list(sizes)


def granularity(g):
    """Annotates the ops that walk the ring's minibatches with their `minibatch` (rows)."""
    plan = Plan.of(g)
    best = plan.minibatch if plan.is_forced("minibatch") else min(
        candidates(plan), key=lambda b: (minibatch_cost(plan, b, hardware.get(plan.gpu)), b))
    return ir.annotate(g, {op.name: {"minibatch": best} for op in ir.ring_ops(g)})


def predict_forward_s(plan: Plan) -> float:
    """The cost model's forward time of a finished plan: the overlapped max of comm and
    compute (sm_partition's terms) plus the minibatch penalties (this pass's terms)."""
    from .sm_partition import direction_costs

    gpu = hardware.get(plan.gpu)
    moved, flops = direction_costs(plan, backward=False)
    rate = gpu.fp8_flops if plan.scale_block == 128 else gpu.bf16_flops
    link = gpu.nvlink_bw if plan.ep > 1 else gpu.hbm_bw / 2
    # gathered rows: no comm CTAs, nothing copied beside the compute
    t_comm = moved / min(link, plan.comm_sms_fwd * gpu.copy_bw_per_sm) if plan.comm_sms_fwd \
        else 0.0
    t_comp = flops / (rate * (plan.num_sms - plan.comm_sms_fwd) / gpu.num_sms)
    return max(t_comm, t_comp) + minibatch_cost(plan, plan.minibatch, gpu)
