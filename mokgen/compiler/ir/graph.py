"""Build, query and check the MoE task graph.

The graph is a networkx DiGraph with two kinds of nodes, both keyed by name:
op nodes (attr `op`: Op) and buffer nodes (attr `buf`: Buffer). Edges go buffer -> op for
a read and op -> buffer for a write, so the graph is bipartite; each buffer has at most one
writer. Graph attrs: `direction`, `dims` (the concrete dims), `symbolic` (symbolic dim ->
meaning), `inputs` / `outputs` / `saved` (buffer names).
"""
from __future__ import annotations

import networkx as nx

from mokgen.shapes import MoEShape

from mokgen.compiler.ir import moe
from mokgen.compiler.ir.builder import GraphBuilder, topo_order
from mokgen.compiler.ir.ops import Op
from mokgen.compiler.ir.render import to_dot, to_text

GRAPH_DIRECTIONS = ("fwd", "bwd", "both")

__all__ = ["build_graph", "ops", "comm_ops", "buffers", "reads", "writes", "validate",
           "to_text", "to_dot"]


def build_graph(shape: MoEShape, ep: int, tokens: int, direction: str = "both") -> nx.DiGraph:
    """The per-rank MoE layer as a task graph.

    `tokens` is N, the tokens this rank routes; `ep` the expert-parallel degree R. With
    direction="bwd" the forward buffers the backward needs (`saved`) become graph inputs.
    """
    if not isinstance(shape, MoEShape):
        raise TypeError(f"shape must be a MoEShape, got {type(shape).__name__}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    if direction not in GRAPH_DIRECTIONS:
        raise ValueError(f"direction must be one of {GRAPH_DIRECTIONS}, got {direction!r}")
    dims = moe.Dims.of(shape, ep, tokens)  # validates ep (positive, divides E)
    shared = bool(shape.shared_experts)

    b = GraphBuilder(moe.buffers(dims, shared))
    if direction in ("fwd", "both"):
        moe.add_forward(b, dims, shared)
    if direction in ("bwd", "both"):
        moe.add_backward(b, dims, shared)

    g = b.g
    g.graph.update(
        name=f"moe_{shape.name or 'layer'}_{direction}",
        direction=direction,
        dims=dict(vars(dims)),
        symbolic={moe.P: moe.P_NOTE},
        p_bound=dims.p_bound(),
        inputs=tuple(moe.inputs(direction, shared)),
        outputs=tuple(moe.outputs(direction, shared)),
        saved=tuple(moe.saved(shared)) if direction != "bwd" else (),
    )
    return g


def ops(g: nx.DiGraph, direction: str | None = None) -> list[Op]:
    """Ops in topological order, optionally only "fwd" or "bwd" ones."""
    if direction not in (None, "fwd", "bwd"):
        raise ValueError(f"direction must be None, 'fwd' or 'bwd', got {direction!r}")
    node_op = dict(g.nodes(data="op"))  # None for buffers
    out = [node_op[n] for n in topo_order(g) if node_op[n] is not None]
    return [op for op in out if direction is None or op.direction == direction]


def comm_ops(g: nx.DiGraph) -> list[Op]:
    """Ops that move tokens between ranks, in topological order."""
    return [op for op in ops(g) if op.comm is not None]


def buffers(g: nx.DiGraph) -> list:
    """Buffers in topological order."""
    return [g.nodes[n]["buf"] for n in topo_order(g) if "buf" in g.nodes[n]]


def reads(g: nx.DiGraph, op_name: str) -> list[str]:
    return list(g.predecessors(op_name))


def writes(g: nx.DiGraph, op_name: str) -> list[str]:
    return list(g.successors(op_name))


def validate(g: nx.DiGraph) -> None:
    """Raise ValueError unless g is a well-formed task graph (see module docstring)."""
    if not isinstance(g, nx.DiGraph) or g.is_multigraph():
        raise ValueError(f"expected a networkx DiGraph, got {type(g).__name__}")
    for n, data in g.nodes(data=True):
        kinds = [k for k in ("op", "buf") if k in data]
        if len(kinds) != 1:
            raise ValueError(f"node {n!r} must carry exactly one of 'op'/'buf', has {kinds}")
        if data[kinds[0]].name != n:
            raise ValueError(f"node {n!r} holds {kinds[0]} named {data[kinds[0]].name!r}")
    for u, v in g.edges:
        if ("op" in g.nodes[u]) == ("op" in g.nodes[v]):
            what = "op" if "op" in g.nodes[u] else "buffer"
            raise ValueError(f"edge {u!r} -> {v!r} joins {what} to {what}; "
                             "edges must go buffer -> op or op -> buffer")
    if not nx.is_directed_acyclic_graph(g):
        loop = nx.find_cycle(g)
        cycle = " -> ".join([u for u, _ in loop] + [loop[0][0]])
        raise ValueError(f"graph has a cycle: {cycle}")
    declared = set(g.graph.get("inputs", ()))
    for n, data in g.nodes(data=True):
        if "op" in data:
            if g.out_degree(n) == 0:
                raise ValueError(f"op {n!r} writes no buffer")
            continue
        writers = list(g.predecessors(n))
        if len(writers) > 1:
            raise ValueError(f"buffer {n!r} has several writers {writers}; "
                             "buffers are single-assignment")
        if writers and n in declared:
            raise ValueError(f"buffer {n!r} is a graph input but {writers[0]!r} writes it")
        if not writers and g.out_degree(n) and n not in declared:
            readers = ", ".join(g.successors(n))
            raise ValueError(f"buffer {n!r} is read by {readers} but nothing writes it "
                             "and it is not a graph input")
    missing = [n for n in declared if n not in g or "buf" not in g.nodes[n]]
    if missing:
        raise ValueError(f"graph inputs {missing} are not buffers of the graph")
