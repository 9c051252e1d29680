"""Whether each differentiable call keeps its own gate/up pre-activations h for its backward
(`keep_h`; runtime/workspace.py KeptActivations), instead of leaving them in the shared ring.

The ring is shared by every layer of a model (one workspace per plan shape), so in a stack only
the last forward's h is still there at its backward: every other layer's backward replays
gate/up (x re-pulled, h recomputed). A call that keeps its own h replays nothing, whatever ran
between its forward and backward, at the cost of its h held from forward to backward (the
ring keeps no h then: the workspace shrinks by as much once).

Keeping h pays for itself in a stack: a layer's step runs about 16% faster than replaying
(Qwen3-30B-A3B, T 8192), for about 240 MiB a layer held (a call keeps only the ring rows its
tokens fill; autograd through torch._grouped_mm saves several times that). With one layer, or
under activation checkpointing (the forward re-runs right before its backward, so the ring
holds its h), the backward runs the default plan's kernel (plan.resident_twin), which is no
slower and peaks lower.

So it is the default wherever its rules hold (limits.keep_h_violations: one rank, bf16, a ring
that holds every minibatch) and the forward copies x (a gathering forward keeps h only when
asked: that pair is untimed); keep_h=False asks for the replaying backward (a model without
checkpointing then holds 36 instead of 276 MiB a layer, and its non-last layers pay the
replay). It runs last: the ring's size decides it, and it re-picks the backward's comm CTAs,
which count x pulls for keep_h plans (passes/sm_partition.py direction_costs)."""
from __future__ import annotations

from mokgen.compiler import ir
from mokgen.compiler.ir import OpKind
from mokgen.compiler.limits import GATHER, keep_h_violations
from mokgen.compiler.plan import Plan
from mokgen.compiler.passes.sm_partition import comm_ctas, role_changes


def keep_h(g):
    """Annotates the gate/up GEMM op with `keep_h` (the forced value, else whether its rules
    hold) and, where that turns it on, the backward's ops with comm CTAs chosen for it."""
    plan = Plan.of(g)
    if plan.is_forced("keep_h"):
        keep = plan.keep_h
    else:  # the forward that gathers x (limits.GATHER) keeps it only when asked: untimed
        keep = plan.dispatch != GATHER and not keep_h_violations(plan.replace(keep_h=True))
    changes = {ir.op_of(g, OpKind.GATE_UP_GEMM).name: {"keep_h": keep}}
    if keep and not plan.keep_h:  # sm_partition priced a backward that finds x in the ring
        sms = plan.num_sms
        changes.update(role_changes(g, "bwd", comm_ctas(plan.replace(keep_h=True), "bwd", sms),
                                    sms))
    return ir.annotate(g, changes)
