"""Name each communication op's direction (paper 3.1; mokgen/compiler/limits.py DIRECTIONS).

The expert rank's comm CTAs pull the rows it computes on (dispatch, reverse-combine) and
the tiles that compute rows push them to their owners (combine, reverse-dispatch), so every
hand-off a GPU waits on is signalled on that GPU: one local flag per minibatch, where the
other way round needs a cross-GPU flag from each of the R ranks. Where a direction has no
comm CTAs (sm_partition.gathers) its row-reading op moves nothing: the GEMMs gather x or dy
from the caller's tensors (GATHER). A forced value (`dispatch="gather"`, ...) stands;
dx_rows may later turn reverse-dispatch to RING.
"""
from __future__ import annotations

from mokgen.compiler import ir
from mokgen.compiler.limits import DIRECTIONS, GATHER
from mokgen.compiler.plan import Plan


def comm_direction(g):
    """Annotates each comm op with its `comm_direction`. Runs after sm_partition."""
    plan = Plan.of(g)
    overrides = g.graph["problem"]["overrides"]
    gathered = {"dispatch": plan.comm_sms_fwd == 0, "reverse_combine": plan.comm_sms_bwd == 0}
    return ir.annotate(g, {op.name: dict(comm_direction=overrides.get(op.comm) or (
        GATHER if gathered.get(op.comm) else DIRECTIONS[op.comm])) for op in ir.comm_ops(g)})
