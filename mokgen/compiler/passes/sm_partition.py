"""Split the SMs between communication and compute, forward and backward separately, after
leaving `reserve_sms` of them to collectives that run beside the layer.

Reserve: the persistent kernels hold one CTA per SM for their whole run, so a collective
launched beside them (an FSDP all-gather on a side stream) waits for the layer to end. With
`overlap_comm=True` the plan keeps `collective_sms(gpu)` SMs free (H100 / H200: 16) and the
kernels launch `num_sms = SMs - reserve_sms` CTAs; `reserve_sms` forces any count (0 turns it off).

Cost model per direction: comm time = bytes moved / min(link bandwidth, c * per-SM copy rate);
compute time = FLOPs / (rate per SM * (num_sms - c)). Overlapped, the layer takes the max of
the two; pick the c that minimizes it (smallest c on ties: compute SMs are the scarce ones).

One rank in bf16 can move no rows at all (`gathers`, asked for with dispatch="gather" or
comm_sms 0): its GEMMs gather x and dy from the caller's tensors (mokgen/compiler/limits.py GATHER), so
every SM computes and no ring holds copies of x or dy; comm_direction then names those ops
"gather". Not the default: the forward gains and the workspace halves, but the backward's
gathered weight-gradient operands slow the training step (measured about 0.85x). The forward
can gather alone (dispatch="gather", reverse_combine="pull"): every SM computes the forward, and the
backward's comm CTAs pull x into the ring beside dy (its moved bytes count both)."""
from __future__ import annotations

from mokgen.compiler import hardware, ir
from mokgen.compiler.limits import GATHER, GEMM_BM, gather_violations
from mokgen.compiler.plan import Plan
from mokgen.compiler.passes.ring import padded_rows  # the tile is not chosen yet: the largest the engine has


def gathers(plan: Plan) -> tuple[bool, bool]:
    """Whether the forward's and the backward's GEMMs gather x (and dy) rows (no comm CTAs):
    asked for (dispatch or reverse_combine "gather", or 0 comm SMs), one rank, bf16, and
    nothing forced that needs a comm CTA (a direction other than the default, comm SMs) or the
    producer's warps. dispatch="gather" alone gathers both ways; the forward gathers alone
    where the backward is forced to copy (reverse_combine "pull" or comm_sms_bwd >= 1)."""
    forced = lambda n, v: plan.is_forced(n) and getattr(plan, n) == v  # noqa: E731
    asked_bwd = forced("reverse_combine", GATHER) or forced("comm_sms_bwd", 0)
    asked = asked_bwd or forced("dispatch", GATHER) or forced("comm_sms_fwd", 0)
    if not asked:
        return False, False
    copies_bwd = (plan.is_forced("reverse_combine") and plan.reverse_combine != GATHER) or \
        (plan.is_forced("comm_sms_bwd") and plan.comm_sms_bwd != 0)
    bwd = not copies_bwd
    # the rules (limits.py) over what is forced, with the undecided directions gathering
    trial = {"dispatch": GATHER, "reverse_combine": GATHER if bwd else None}
    if gather_violations(plan.replace(**{op: v for op, v in trial.items()
                                         if getattr(plan, op) is None and v})):
        return False, False
    if plan.is_forced("macrobatch"):  # a ring row must be its layout row: it holds them all
        s = plan.shape  # (the rule's own check waits for the ring pass's row count)
        worst = padded_rows(plan.tokens_per_rank * min(s.topk, plan.local_experts),
                            plan.local_experts, max(GEMM_BM))
        if plan.macrobatch < worst:
            return False, False
    return True, bwd


def collective_sms(gpu: hardware.GPU) -> int:
    """SMs to leave to a collective beside the layer: enough that their copy rate covers one
    direction of the link (NCCL's channels are one CTA each, and a channel moves about what a
    copying SM moves), rounded up to a power of two, as NCCL picks its channel counts. H200
    and H100 SXM: 450 GB/s / 40 GB/s = 11.3 -> 16, 12% of the SMs (the layer's compute loses
    as much while the collective gains the whole link); H800 (200 GB/s): 8; H100 PCIe: 2. Tell NCCL to use no more: NCCL_MAX_CTAS, or the
    process group's `ProcessGroupNCCL.Options().config.max_ctas`."""
    need = -(-gpu.nvlink_bw // gpu.copy_bw_per_sm)
    return min(gpu.num_sms // 2, 1 << (int(need) - 1).bit_length())


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
        # read bf16), and so do the plans whose forward gathered x (limits.GATHER: its ring
        # holds no x) or whose calls keep their own h (keep_h: the ring's x is the last call's).
        # Those x pulls beside dy count at 3x their bytes: calibrated, not derived (at their
        # bytes the model picks too few backward comm CTAs, measured slower).
        pulls_x = plan.reverse_combine != GATHER and (plan.dispatch == GATHER or plan.keep_h)
        moved = rows * 2 * s.hidden * (5 if pulls_x else 3 if plan.scale_block else 2)
    return moved, flops


def best_comm_sms(moved: float, flops: float, gpu: hardware.GPU, rate: float, ep: int,
                  sms: int | None = None, link: float | None = None) -> int:
    """The comm CTA count of `sms` CTAs (default: every SM) minimizing max(comm, compute).
    `link`: the fabric's bytes/s (default: NVLink; on one rank rows are local HBM copies)."""
    sms = sms or gpu.num_sms
    if link is None:
        link = gpu.nvlink_bw if ep > 1 else gpu.hbm_bw / 2
    per_sm = rate / gpu.num_sms
    best = None
    for c in range(1, sms // 2 + 1):
        t_comm = moved / min(link, c * gpu.copy_bw_per_sm)
        t_comp = flops / (per_sm * (sms - c))
        t = max(t_comm, t_comp)
        if best is None or t < best[0] * (1 - 1e-9):
            best = (t, c)
    return best[1]


def comm_ctas(plan: Plan, direction: str, sms: int) -> int:
    """The comm CTAs of `direction`'s ("fwd" / "bwd") launch of `sms` CTAs: 0 where its GEMMs
    gather, the forced count, else the cost model's."""
    name = f"comm_sms_{direction}"
    if gathers(plan)[direction == "bwd"]:
        return 0
    if plan.is_forced(name):
        c = getattr(plan, name)
        if c >= sms:
            raise ValueError(f"{name} must be < {sms} (the CTAs left after reserving "
                             f"{plan.target.num_sms - sms} SMs), got {c}")
        return c
    gpu = plan.target
    rate = gpu.fp8_flops if plan.scale_block == 128 else gpu.bf16_flops
    moved, flops = direction_costs(plan, backward=direction == "bwd")
    c = best_comm_sms(moved, flops, gpu, rate, plan.ep, sms)
    # multicast pairs: a 2-CTA cluster's CTAs take one role (limits.pair_violations)
    if direction == "fwd" and plan.gemm_fwd is not None and plan.gemm_fwd.pair:
        c += c % 2
    return c


def role_changes(g, direction: str, comm: int, sms: int) -> dict:
    """annotate() changes giving `direction`'s megakernel ops their role and CTAs."""
    return {op.name: dict(sm_role="comm", ctas=comm) if op.comm else
            dict(sm_role="compute", ctas=sms - comm)
            for op in ir.ops(g, direction) if op.attr("stage") == "megakernel"}


def sm_partition(g):
    """Annotates every op of the megakernels with its `sm_role`, "comm" (the comm ops) or
    "compute", and the `ctas` its launch gives that role."""
    plan = Plan.of(g)
    gpu = plan.target
    reserve = plan.reserve_sms if plan.is_forced("reserve_sms") else \
        collective_sms(gpu) if plan.overlap_comm else 0
    sms = gpu.num_sms - reserve
    changes = {}
    for d in ("fwd", "bwd"):
        changes.update(role_changes(g, d, comm_ctas(plan, d, sms), sms))
    return ir.annotate(g, changes)
