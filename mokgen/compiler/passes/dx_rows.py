"""Where the backward's dx rows go at one rank: over their own dy rows in the ring
(`reverse_dispatch="ring"`, mokgen/compiler/limits.py RING) instead of into the combine rows.

A dx row's dy row is dead once its expert's dgrad and dW2 tiles have read it, so the dx tiles
run last (moe_bwd.cuh DXRING: each waits for its expert's dW2) and write there; the owner's
sum then reads each route's row where the schedule table put it, in the same order, so dx is
bitwise the pushed rows'. The backward writes no combine rows, and the forward is done with
them once it summed them: the dy ring lives in them (runtime/peers.py combine_rows), which
saves N k D bf16 bytes of workspace, the combine rows or the dy ring whichever is smaller.

It needs a dy ring that holds every minibatch (no slot is reused while its dy rows hold dx
rows), one rank and bf16 (the fp8 dx tiles' epilogue is not written for it); it is chosen
there unless reverse_dispatch is forced. Runs after ring (it reads the macrobatch)."""
from __future__ import annotations

from mokgen.compiler import ir
from mokgen.compiler.limits import RING, ring_violations
from mokgen.compiler.plan import Plan


def dx_rows(g):
    """Annotates the reverse-dispatch op with comm_direction RING where the plan allows it
    and reverse_dispatch was left to the planner (push, the paper's, otherwise stays)."""
    plan = Plan.of(g)
    if plan.is_forced("reverse_dispatch") or plan.reverse_dispatch != "push":
        return g
    trial = plan.replace(reverse_dispatch=RING)
    if ring_violations(trial):
        return g
    return ir.annotate(g, {op.name: {"comm_direction": RING} for op in ir.comm_ops(g)
                           if op.comm == "reverse_dispatch"})
