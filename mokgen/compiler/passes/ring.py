"""The macrobatch ring (paper 3.3): a fixed on-device buffer of `macrobatch` rows that routed
tokens cycle through, so routed counts never reach the host and nothing is dropped.

Rows are laid out expert by expert, each expert's region padded to the GEMM tile so no tile
mixes experts; slots are used round-robin in processing order, and the ring holds at least
two minibatches (the kernel's down tiles of one minibatch overlap the next one's gate/up
tiles). Forward walks macrobatches in
reverse, so it ends with macrobatch 0 (always full unless everything fits) resident; the
backward replays (re-pulls x and recomputes gate/up for) every row at or past `macrobatch`.
"""
from __future__ import annotations

from mokgen.compiler import ir
from mokgen.compiler.ir import OpKind
from mokgen.compiler.limits import GATHER
from mokgen.compiler.plan import Plan


def ring_row_bytes(plan: Plan) -> int:
    """Bytes one ring row holds: the dispatched x row, the gate/up pre-activation kept for the
    backward, and the SwiGLU output the down GEMM reads."""
    s, q = plan.shape, plan.scale_block
    if q:  # e4m3 x and SwiGLU output plus fp32 scales (the bf16 rings stay, for the shared path)
        fp8 = s.hidden + 4 * -(-s.hidden // q) + s.intermediate + 4 * -(-s.intermediate // q)
        return 2 * s.hidden + 2 * (2 * s.intermediate) + 2 * s.intermediate + fp8
    # gathered both ways: x stays in place (a forward that gathers alone leaves the ring's x
    # rows to the backward's comm CTAs)
    x_row = 0 if plan.reverse_combine == GATHER else plan.row_bytes
    return x_row + 2 * (2 * s.intermediate) + 2 * s.intermediate


def padded_rows(rows: int, experts: int, tile: int) -> int:
    """Upper bound of rows after padding each of `experts` regions to a multiple of `tile`."""
    return rows + experts * (tile - 1)


def ring(g):
    """Annotates the ops that walk the ring with its size in rows (`ring_rows`, the
    macrobatch) and the schedule that places rows in it with the tile its expert regions are
    padded to (`pad_rows`); the graph's `ring` attr reports its bytes and expected use."""
    plan = Plan.of(g)
    s, b = plan.shape, plan.minibatch
    L = plan.local_experts
    expected = padded_rows(plan.tokens_per_rank * s.topk, L, plan.block_m)
    # A token's k routes go to distinct experts, so one rank gets at most min(k, L) per token.
    worst = padded_rows(plan.ep * plan.tokens_per_rank * min(s.topk, L), L, plan.block_m)
    row = ring_row_bytes(plan)
    if plan.is_forced("macrobatch"):
        macro = plan.macrobatch
    elif plan.dispatch == GATHER:  # a ring row is its layout row: the ring holds them all
        macro = max(2 * b, -(-worst // b) * b)
    else:
        fits = (plan.ring_budget_bytes // row) // b * b
        want = -(-expected // b) * b  # hold every expected row: no replay when routing is even
        macro = max(2 * b, min(fits, want))
    if macro % b or macro < 2 * b:
        raise ValueError(f"macrobatch must be a multiple of the minibatch ({b}) and hold at "
                         f"least two minibatches, got {macro}")
    changes = {op.name: {"ring_rows": macro} for op in ir.ring_ops(g)}
    changes[OpKind.SCHEDULE_BUILD.value]["pad_rows"] = plan.block_m
    return ir.annotate(g, changes, ring=dict(
        ring_bytes=macro * row, max_routed_rows=worst, expected_routed_rows=expected,
        expected_replay_rows=max(0, expected - macro)))
