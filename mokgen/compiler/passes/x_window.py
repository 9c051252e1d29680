"""The backward's x ring as a window of a few minibatch slots (`x_slots`, FwdConsts XSLOTS)
where the forward gathers x (dispatch "gather", reverse_combine "pull": limits.py GATHER).

There the forward keeps no x rows: the backward's comm CTAs copy them into the ring minibatch
by minibatch (FwdConsts XPULL). Only two kinds of tile read them: a replay tile (one
minibatch's rows) and dW1 (one expert's rows, K-wise). An expert has at most one row per token
(a token's routes go to distinct experts), so its rows span a bounded number of minibatches,
and a slot can be refilled once the dW1 tiles of every expert in its previous minibatch are
done (moe_bwd.cuh wait_x_slot). The window holds the fewest slots that keep that wait behind
tasks listed before the refill (limits.x_window_min_slots): the x ring shrinks from the whole
macrobatch to that many minibatches (Qwen3-30B-A3B at T 8192: 20 slots -> 4, workspace
1,101 -> 837 MiB), and the step runs as fast as with the whole ring.

It runs after ring (it reads the minibatch and the ring's slots), where its rules hold
(limits.x_window_violations) and the window is smaller than the ring, unless x_slots is forced."""
from __future__ import annotations

from mokgen.compiler import ir
from mokgen.compiler.limits import x_window_min_slots, x_window_violations
from mokgen.compiler.plan import Plan


def x_window(g):
    """Annotates the reverse-combine op (whose comm CTAs pull x) with x_slots: the forced
    value, or the fewest slots where the window is allowed and smaller than the ring."""
    plan = Plan.of(g)
    if plan.is_forced("x_slots"):
        slots = plan.x_slots
    else:
        slots = x_window_min_slots(plan)
        if slots is None or slots >= plan.ring_slots or \
                x_window_violations(plan.replace(x_slots=slots)):
            return g
    return ir.annotate(g, {op.name: {"x_slots": slots} for op in ir.comm_ops(g)
                           if op.comm == "reverse_combine"})
