"""The planner: the problem's task graph through every pass (`passes.PASSES`), then the
kernels' rules (`limits.check`). The one place the plan module meets the passes."""
from __future__ import annotations

import dataclasses

from mokgen.compiler.limits import check
from mokgen.compiler.passes import run
from mokgen.compiler.plan import Plan, initial_graph
from mokgen.shapes import MoEShape


def plan(shape: MoEShape, ep: int, dtype: str = "bf16", tokens_per_rank: int = 2048,
         **overrides) -> Plan:
    """Run the planning passes over the layer's task graph (no compiler, no GPU needed), then
    the kernels' rules (`mokgen.compiler.limits`): the view of the annotated graph comes back only if
    its layer compiles, else ValueError.

    The plan is for `gpu=` ("h100-sxm", "h200", "h800", "h100-pcie", "h20", or a
    `hardware.GPU`), else $MOKGEN_GPU, else the current CUDA device, else the H200
    (mokgen/compiler/hardware.py `target`): its SM count sizes the grids and the SM
    partition, its rates the cost models. `arch="sm_90a"` alone: the current device if it is
    one, else the H200."""
    p = Plan.of(run(initial_graph(shape, ep, dtype, tokens_per_rank, **overrides)))
    check(p)
    return p


def annotated(plan: Plan):
    """The annotated task graph `plan` views: its own, or (a plan from JSON or `replace`)
    the passes' graph with the plan's decisions forced, refused unless it gives the plan's
    every field back."""
    if plan.graph is not None:
        return plan.graph
    g = run(initial_graph(plan.shape, plan.ep, plan.dtype, plan.tokens_per_rank,
                          **plan.decisions()))
    again = Plan.of(g).replace(forced=plan.forced)
    off = [f"{f.name}={getattr(plan, f.name)!r} (its decisions give "
           f"{getattr(again, f.name)!r})" for f in dataclasses.fields(Plan)
           if f.compare and getattr(plan, f.name) != getattr(again, f.name)]
    if off:
        raise ValueError(f"the plan is not what its decisions make: {'; '.join(off)}")
    return g


def resident_twin(plan: Plan) -> Plan | None:
    """keep_h plans: the plan whose backward kernel serves a call whose ring still holds its
    own forward (BwdBuffers::resident 2: nothing ran on the layer since, as with one layer or
    under activation checkpointing, which re-runs each forward right before its backward).
    Its h is the call's kept h (ring layout, handed in as ring_h), its x the ring's, so the
    backward pulls dy alone: the plan's own kernel (x pulled, comm CTAs sized for x pulls:
    sm_partition) would idle the CTAs counted for x. The twin is the plan without keep_h,
    every other decision forced, its backward's comm CTAs chosen anew unless the caller forced
    them; so the kernel is the default plan's, and the gradients are bitwise the default's.
    None for other plans."""
    if not plan.keep_h:
        return None
    d = dict(plan.decisions(), keep_h=False)
    if not plan.is_forced("comm_sms_bwd"):
        del d["comm_sms_bwd"]
    g = run(initial_graph(plan.shape, plan.ep, plan.dtype, plan.tokens_per_rank, **d))
    twin = Plan.of(g)
    same = ("minibatch", "macrobatch", "x_slots", "gemm_bwd", "reverse_combine",
            "reverse_dispatch", "max_routed_rows", "num_sms")
    off = [k for k in same if getattr(twin, k) != getattr(plan, k)]
    if off:  # the twin's kernel must read the keep_h plan's workspace as it is
        raise ValueError(f"keep_h plan's resident twin differs in {off}")
    return twin
