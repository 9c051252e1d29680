"""Minibatch size b from the paper's model (3.2): P_fine(b) + P_coarse(b), with
P_fine = ceil(rows / b) * C_ineff(b) and P_coarse = T_dispatch(b) + T_combine(b), plus
the HBM re-reads of the experts' weights that each minibatch makes (weight_reread_s), where
they are a material share of the compute (REREAD_MARGIN).

C_ineff(b) is what one minibatch wastes: a flag hand-off, plus the tensor-core time lost to
the last partial wave of its gate/up and down tiles over the compute SMs. Candidates are
multiples of the GEMM tile; the smallest b wins ties (less exposed latency)."""
from __future__ import annotations

import math

from mokgen.compiler import hardware, ir
from mokgen.compiler.plan import Plan

# Output columns per tile in the model. The kernels' tiles are BN = plan.gemm_fwd.bn = 256 wide
# (the rows, plan.block_m, are theirs): counting their tiles moves the minibatch of most
# default plans, and the plans it picks measured slower.
MODEL_TILE_N = 128


def minibatch_cost(plan: Plan, b: int, gpu: hardware.GPU, link: float | None = None,
                   backward: bool = False, rereads: bool = True) -> float:
    """The forward's minibatch terms. `link`: the fabric's bytes/s (default: NVLink; one
    rank: HBM copies). backward: add the backward's weight re-reads (the pass's choice
    serves both directions: the backward walks the forward's minibatches). rereads=False:
    without the weight re-reads (weight_reread_s), which the pass weighs on their own."""
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
    terms = math.ceil(rows / b) * waste + t_dispatch + t_combine
    return terms + weight_reread_s(plan, b, gpu) * (2 if backward else 1) if rereads else terms


def weight_reread_s(plan: Plan, b: int, gpu: hardware.GPU) -> float:
    """A minibatch's row tiles of one output column run side by side (the task list walks a
    minibatch's rows fastest), so each B tile comes from HBM once a minibatch and is gone from
    L2 by the next: every minibatch reads the weights of each local expert its rows touch, in
    each direction (forward gate/up and down; backward dx and dgrad read them again). An expert
    of r rows is touched by about r / b + 1 minibatches: larger minibatches re-read less, the
    more so the larger the experts (Mixtral-8x7B: 352 MB an expert). One direction's, counted
    at gpu.hbm_exposed of the bytes' HBM time (the measured share: hardware.py)."""
    s = plan.shape
    rows = plan.tokens_per_rank * s.topk
    local = plan.local_experts
    full, last = divmod(rows, b)  # full minibatches, and the last one's rows (0: none)
    # experts a minibatch of m rows reads: its share of them, plus the one it shares with the
    # minibatch before (an expert straddling a boundary is read by both)
    touched = lambda m: min(local, m * local / max(rows, 1) + 1)  # noqa: E731
    reads = full * touched(b) + (touched(last) if last else 0)
    elem = 1 if plan.scale_block else 2  # fp8 / MXFP8 weights: a byte an element
    weights = 3 * s.hidden * s.intermediate * elem  # w1 (gate, up) and w2 of one expert
    return gpu.hbm_exposed * reads * weights / gpu.hbm_bw


def candidates(plan: Plan) -> list[int]:
    rows = plan.tokens_per_rank * plan.shape.topk
    top = max(plan.block_m, -(-rows // plan.block_m) * plan.block_m)
    sizes = range(plan.block_m, top + 1, plan.block_m)
    if plan.is_forced("macrobatch"):  # a forced ring must hold >= 2 whole minibatches
        sizes = [b for b in sizes if plan.macrobatch % b == 0 and plan.macrobatch >= 2 * b]
        sizes = sizes or [plan.block_m]
    return list(sizes)


# The weight re-reads move the choice off the flag and wave terms' only where the re-reads
# they save come to at least this share of the forward's compute time. Those terms misprice
# near-equal candidates by a few percent, and a re-read term worth less than that only
# reshuffled their ranking. Fit on sweeps of 21 problems: the moves that saved more than ~4%
# gained on average (the large experts: Mixtral, Llama-4-Scout, Phi-3.5-MoE, DeepSeek-V2),
# those that saved less lost on average (the many-small-expert shapes).
REREAD_MARGIN = 0.04


def granularity(g):
    """Annotates the ops that walk the ring's minibatches with their `minibatch` (rows)."""
    plan = Plan.of(g)
    if plan.is_forced("minibatch"):
        best = plan.minibatch
    else:
        gpu, backward = plan.target, plan.gemm_bwd is not None
        cands = candidates(plan)
        terms = {b: minibatch_cost(plan, b, gpu, rereads=False) for b in cands}
        rereads = {b: weight_reread_s(plan, b, gpu) * (2 if backward else 1) for b in cands}
        best = min(cands, key=lambda b: (terms[b] + rereads[b], b))
        base = min(cands, key=lambda b: (terms[b], b))  # without the re-reads
        if rereads[base] - rereads[best] < REREAD_MARGIN * forward_compute_s(plan, gpu):
            best = base
    return ir.annotate(g, {op.name: {"minibatch": best} for op in ir.ring_ops(g)})


def forward_compute_s(plan: Plan, gpu: hardware.GPU) -> float:
    """The forward's GEMMs at the compute SMs' tensor rate (sm_partition's compute term)."""
    from mokgen.compiler.passes.sm_partition import direction_costs

    _, flops = direction_costs(plan, backward=False)
    rate = gpu.fp8_flops if plan.scale_block == 128 else gpu.bf16_flops
    return flops / (rate * (plan.num_sms - plan.comm_sms_fwd) / gpu.num_sms)


def predict_forward_s(plan: Plan) -> float:
    """The cost model's forward time of a finished plan: the overlapped max of comm and
    compute (sm_partition's terms) plus the minibatch penalties (this pass's terms)."""
    from mokgen.compiler.passes.sm_partition import direction_costs

    gpu = plan.target
    moved, _ = direction_costs(plan, backward=False)
    link = gpu.nvlink_bw if plan.ep > 1 else gpu.hbm_bw / 2
    # gathered rows: no comm CTAs, nothing copied beside the compute
    t_comm = moved / min(link, plan.comm_sms_fwd * gpu.copy_bw_per_sm) if plan.comm_sms_fwd \
        else 0.0
    t_comp = forward_compute_s(plan, gpu)
    return max(t_comm, t_comp) + minibatch_cost(plan, plan.minibatch, gpu)
