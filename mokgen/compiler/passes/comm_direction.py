"""Pick, per communication op, push or pull (paper 3.1) by a cost model of the topology.

Signals are counted per minibatch on the receiving rank, for R ranks:
- pull: the consumer issued every load itself, so one GPU-local flag says "arrived".
- push: each of the R producers must tell the consumer its part landed: R cross-GPU flags.
For combine (and reverse-dispatch) the consumer of the *hand-off* is the comm side of the
expert rank waiting on its own compute, so push is the local one and pull would need every
owner to poll R peers per minibatch.

The forward's two ops are implemented both ways (moe_fwd.cuh, direction.cuh) and chosen
together, since they share the comm CTAs: `forward_costs` prices each of the four combinations
as the time its copies and signals take on one rank, per call:
- bytes: the routed rows each rank receives (dispatch) and sends back (combine); a pushing
  source or a pulling owner also reads the peer's schedule table (8 bytes a row) to find its
  rows, at every rank;
- the SMs that issue them: pull dispatch and push dispatch use the dispatch comm CTAs (all
  comm CTAs, or all but the combine's half with pull combine); push combine is stored by the
  compute CTAs' down epilogues (many SMs, stolen from the GEMMs), pull combine by half of
  the comm CTAs; each side runs at min(link, SMs x per-SM copy rate) (mokgen/compiler/hardware.py);
- signals: local ones x the GPU-local hand-off latency, cross-GPU ones x the peer flag
  latency, per minibatch (a push dispatch also polls the peer's slot-free flag: one more).
The backward's two ops are implemented both ways too (moe_bwd.cuh, direction_bwd.cuh) and
priced the same way by `backward_costs`, per call on one rank:
- bytes: the dy rows each rank receives (reverse-combine) and the dx rows (+ their 4-byte
  router-weight gradients) it sends back (reverse-dispatch); a pushing owner or a pulling
  owner reads every peer's schedule table to find its rows;
- SMs: pull reverse-combine and push reverse-combine use the dy comm CTAs (all backward comm
  CTAs, or all but the dx half with pull reverse-dispatch), which also re-pull x for the
  minibatches the ring lost (the same bytes either way: left out); push reverse-dispatch is
  stored by the dx epilogues (the compute SMs), pull reverse-dispatch by half the comm CTAs;
- signals: as the forward's (a push reverse-combine also polls the peer's slot-free flag).
Overrides (`dispatch="push"`, ...) force an op; the model then picks the other of its
direction around it.
"""
from __future__ import annotations

import itertools
import math

from mokgen.compiler import ir
from mokgen.compiler.limits import DIRECTIONS, GATHER
from mokgen.compiler.plan import Plan

# Which side must learn that data is ready: "dst" = the rank that receives the rows and
# computes on them (dispatch, reverse-combine); "src" = the rank that produced rows on its
# own compute SMs and hands them to another rank (combine, reverse-dispatch).
_WAITER = {"dispatch": "dst", "reverse_combine": "dst",
           "combine": "src", "reverse_dispatch": "src"}
TABLE_ENTRY_BYTES = 8  # int2 (src rank, src route) per ring-layout row


def signal_counts(op: str, direction: str, ranks: int) -> tuple[int, int]:
    """(GPU-local, cross-GPU) completion signals per minibatch for `op` moved by `direction`."""
    # The rank that issues the transfers knows locally when they are done. The waiter is
    # local to that knowledge iff it is the issuer.
    issuer = "dst" if direction == "pull" else "src"
    if issuer == _WAITER[op]:
        return 1, 0
    return 0, ranks if ranks > 1 else 0


def forward_costs(plan: Plan, dispatch: str, combine: str) -> dict:
    """Seconds one rank spends on the forward's dispatch and combine moved that way
    ({"dispatch", "combine", "total"}; inf where the kernels cannot run it: pull combine
    needs two comm CTAs). `plan` has its SM split, minibatch and row bytes decided."""
    gpu = plan.target
    s, R, c = plan.shape, plan.ep, plan.comm_sms_fwd
    cc = c // 2 if combine == "pull" else 0
    if combine == "pull" and cc < 1:
        return dict(dispatch=math.inf, combine=math.inf, total=math.inf)
    rows = plan.tokens_per_rank * s.topk  # expected rows per rank, uniform routing
    minibatches = math.ceil(rows / plan.minibatch)
    link = gpu.nvlink_bw if R > 1 else gpu.hbm_bw / 2
    rate = lambda sms: min(link, sms * gpu.copy_bw_per_sm)  # noqa: E731
    table = rows * TABLE_ENTRY_BYTES * R  # every peer's whole table is scanned

    def signals(op, d, extra_cross=0):
        local, cross = signal_counts(op, d, R)
        cross += extra_cross if cross else 0
        local = max(local, 1 - min(cross, 1))  # one rank: its own pushes still signal
        return minibatches * (local * gpu.flag_latency + cross * gpu.peer_flag_latency)

    moved_d = rows * plan.row_bytes + (table if dispatch == "push" else 0)
    t_d = moved_d / rate(c - cc) + signals("dispatch", dispatch, extra_cross=1)
    moved_c = rows * 2 * s.hidden
    if combine == "push":
        t_c = moved_c / rate(plan.num_sms - c) + signals("combine", combine)
    else:
        t_c = (moved_c + table) / rate(cc) + signals("combine", combine)
    return dict(dispatch=t_d, combine=t_c, total=t_d + t_c)


def backward_costs(plan: Plan, reverse_combine: str, reverse_dispatch: str) -> dict:
    """Seconds one rank spends on the backward's reverse-combine and reverse-dispatch moved
    that way ({"reverse_combine", "reverse_dispatch", "total"}; inf where the kernels cannot
    run it: pull reverse-dispatch needs two comm CTAs, push reverse-combine bf16 rows)."""
    gpu = plan.target
    s, R, c = plan.shape, plan.ep, plan.comm_sms_bwd
    cc = c // 2 if reverse_dispatch == "pull" else 0
    if (reverse_dispatch == "pull" and cc < 1) or \
            (reverse_combine == "push" and plan.scale_block):
        return dict(reverse_combine=math.inf, reverse_dispatch=math.inf, total=math.inf)
    rows = plan.tokens_per_rank * s.topk
    minibatches = math.ceil(rows / plan.minibatch)
    link = gpu.nvlink_bw if R > 1 else gpu.hbm_bw / 2
    rate = lambda sms: min(link, sms * gpu.copy_bw_per_sm)  # noqa: E731
    table = rows * TABLE_ENTRY_BYTES * R

    def signals(op, d, extra_cross=0):
        local, cross = signal_counts(op, d, R)
        cross += extra_cross if cross else 0
        local = max(local, 1 - min(cross, 1))  # one rank: its own pushes still signal
        return minibatches * (local * gpu.flag_latency + cross * gpu.peer_flag_latency)

    moved_rc = rows * 2 * s.hidden + (table if reverse_combine == "push" else 0)
    t_rc = moved_rc / rate(c - cc) + signals("reverse_combine", reverse_combine, extra_cross=1)
    moved_rd = rows * (2 * s.hidden + 4)
    if reverse_dispatch == "push":
        t_rd = moved_rd / rate(plan.num_sms - c) + signals("reverse_dispatch", "push")
    else:
        t_rd = (moved_rd + table) / rate(cc) + signals("reverse_dispatch", "pull")
    return dict(reverse_combine=t_rc, reverse_dispatch=t_rd, total=t_rc + t_rd)


def _choose(plan: Plan, forced: dict, ops: tuple, costs) -> tuple[str, str]:
    """The directions of `ops` (a pair) of least modeled time among the implemented ones
    that agree with `forced`; ties keep the paper's choice."""
    paper = tuple(_paper_choice(op) for op in ops)
    options = [o for o in itertools.product(*(DIRECTIONS[op] for op in ops))
               if all(forced.get(op, d) == d for op, d in zip(ops, o))]
    if not options:  # a forced direction the kernels lack: limits.check says so
        return tuple(forced.get(op, p) for op, p in zip(ops, paper))
    cost = {o: costs(plan, *o)["total"] for o in options}
    best = min(options, key=cost.get)
    return paper if paper in cost and cost[paper] <= cost[best] * (1 + 1e-9) else best


def choose_backward(plan: Plan, forced: dict) -> tuple[str, str]:
    """The (reverse_combine, reverse_dispatch) of least modeled time (as choose_forward)."""
    return _choose(plan, forced, ("reverse_combine", "reverse_dispatch"), backward_costs)


def choose_forward(plan: Plan, forced: dict) -> tuple[str, str]:
    """The (dispatch, combine) of least modeled time among the implemented ones that agree
    with `forced`; ties keep the paper's choice."""
    options = [(d, c) for d, c in itertools.product(DIRECTIONS["dispatch"],
                                                     DIRECTIONS["combine"])
               if forced.get("dispatch", d) == d and forced.get("combine", c) == c]
    if not options:  # a forced direction the kernels lack: limits.check says so
        return forced.get("dispatch", "pull"), forced.get("combine", "push")
    cost = {o: forward_costs(plan, *o)["total"] for o in options}
    best = min(options, key=cost.get)
    paper = ("pull", "push")
    return paper if paper in cost and cost[paper] <= cost[best] * (1 + 1e-9) else best


def comm_direction(g):
    """Annotates each comm op with its `comm_direction` and its `signals` per minibatch
    either way, ((direction, local, cross), ...). Runs after granularity (the model needs
    the SM split and the minibatch)."""
    problem = g.graph["problem"]
    plan = Plan.of(g)
    overrides = problem["overrides"]
    # no comm CTAs (sm_partition.gathers): the GEMMs gather the rows, the outputs go the
    # default way (the down and dx epilogues store them)
    chosen = dict(dispatch=GATHER, combine="push") if plan.comm_sms_fwd == 0 else \
        dict(zip(("dispatch", "combine"), choose_forward(plan, overrides)))
    chosen.update(dict(reverse_combine=GATHER, reverse_dispatch="push")
                  if plan.comm_sms_bwd == 0 else
                  zip(("reverse_combine", "reverse_dispatch"), choose_backward(plan, overrides)))
    changes = {}
    for op in ir.comm_ops(g):
        counts = {d: signal_counts(op.comm, d, problem["ep"]) for d in ("pull", "push")}
        direction = overrides.get(op.comm) or chosen.get(op.comm) or _paper_choice(op.comm)
        changes[op.name] = dict(comm_direction=direction,
                                signals=tuple((d, *c) for d, c in counts.items()))
    return ir.annotate(g, changes)


def _paper_choice(op: str) -> str:
    return "pull" if _WAITER[op] == "dst" else "push"
