"""Pick, per communication op, the direction in which the GPU that consumes the completion
signal also issues the transfers (paper 3.1): its hand-off then never leaves the GPU.

Signals are counted per minibatch on the receiving rank, for R ranks:
- pull: the consumer issued every load itself, so one GPU-local flag says "arrived".
- push: each of the R producers must tell the consumer its part landed: R cross-GPU flags.
For combine (and reverse-dispatch) the consumer of the *hand-off* is the comm side of the
expert rank waiting on its own compute, so push is the local one and pull would need every
owner to poll R peers per minibatch.
"""
from __future__ import annotations

from .. import ir

# Which side must learn that data is ready: "dst" = the rank that receives the rows and
# computes on them (dispatch, reverse-combine); "src" = the rank that produced rows on its
# own compute SMs and hands them to another rank (combine, reverse-dispatch).
_WAITER = {"dispatch": "dst", "reverse_combine": "dst",
           "combine": "src", "reverse_dispatch": "src"}


def signal_counts(op: str, direction: str, ranks: int) -> tuple[int, int]:
    """(GPU-local, cross-GPU) completion signals per minibatch for `op` moved by `direction`."""
    # The rank that issues the transfers knows locally when they are done. The waiter is
    # local to that knowledge iff it is the issuer.
    issuer = "dst" if direction == "pull" else "src"
    if issuer == _WAITER[op]:
        return 1, 0
    return 0, ranks if ranks > 1 else 0


def comm_direction(g):
    """Annotates each comm op with its `comm_direction` and its `signals` per minibatch
    either way, ((direction, local, cross), ...)."""
    problem = g.graph["problem"]
    changes = {}
    for op in ir.comm_ops(g):
        counts = {d: signal_counts(op.comm, d, problem["ep"]) for d in ("pull", "push")}
        # Fewest cross-GPU signals; ties (ep=1) keep the paper's choice for that op.
        chosen = problem["overrides"].get(op.comm) or min(
            ("pull", "push"), key=lambda d: (counts[d][1], d != _paper_choice(op.comm)))
        changes[op.name] = dict(comm_direction=chosen,
                                signals=tuple((d, *c) for d, c in counts.items()))
    return ir.annotate(g, changes)


def _paper_choice(op: str) -> str:
    return "pull" if _WAITER[op] == "dst" else "push"
