"""Reading and annotating the operators of a task graph, for the passes and their views.

A pass never edits the graph it is given: `annotate` returns a copy whose ops carry the new
attrs (ops are frozen; the copy holds new Op objects, the input keeps the old ones).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import networkx as nx

from mokgen.compiler.ir.graph import ops, reads, writes
from mokgen.compiler.ir.ops import Op, OpKind


def annotate(g: nx.DiGraph, changes: Mapping[str, Mapping[str, Any]],
             **graph_attrs) -> nx.DiGraph:
    """A copy of `g` whose ops named in `changes` also carry those attrs, and whose graph
    attrs also hold `graph_attrs`."""
    out = nx.DiGraph()
    out.graph.update(g.graph)
    out.add_nodes_from(g.nodes(data=True))  # fresh attr dicts per node: `g` stays as it was
    # edges by target, in each node's predecessor order: ops keep their operands' order
    out.add_edges_from((u, v) for v in g for u in g.pred[v])
    for name, attrs in changes.items():
        out.nodes[name]["op"] = out.nodes[name]["op"].with_attrs(**attrs)
    out.graph.update(graph_attrs)
    return out


def gemm_ops(g: nx.DiGraph, direction: str | None = None) -> list[Op]:
    """Ops that run GEMMs on the tile engine (their `gemms` attr lists the sizes)."""
    return [op for op in ops(g, direction) if op.attr("gemms")]


def ring_ops(g: nx.DiGraph, direction: str | None = None) -> list[Op]:
    """Ops that read or write the ring, and the schedule that places rows in it: the ops
    that walk the layer's minibatches."""
    def on_ring(op):
        names = reads(g, op.name) + writes(g, op.name)
        return any(g.nodes[n]["buf"].space == "ring" for n in names)
    return [op for op in ops(g, direction)
            if op.kind is OpKind.SCHEDULE_BUILD or on_ring(op)]


def op_of(g: nx.DiGraph, kind: OpKind) -> Op | None:
    """The graph's op of `kind` (each kind appears at most once), or None."""
    found = [o for o in ops(g) if o.kind is kind]
    return found[0] if found else None


def common(of: Iterable[Op], key: str, default: Any = None) -> Any:
    """The value of attr `key` that every op of `of` carrying it agrees on (`default` when
    none carries it). Ops of one kernel share one value of what the kernel instantiates once
    (its tile engine, its comm CTAs, the ring); a ValueError names two ops that differ."""
    seen: dict[Any, str] = {}
    for o in of:
        if key in dict(o.attrs):
            seen.setdefault(o.attr(key), o.name)
    if len(seen) > 1:
        (a, na), (b, nb) = list(seen.items())[:2]
        raise ValueError(f"{na} has {key}={a} but {nb} has {key}={b}: the ops of one kernel "
                         f"share one {key}")
    return next(iter(seen), default)
