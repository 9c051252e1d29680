"""A small helper that turns "op reads A, B and writes C" statements into the bipartite graph.

Buffers are declared once in a catalog and enter the graph the first time an op touches
them, so building only the backward pulls in exactly the forward buffers it needs.
"""
from __future__ import annotations

from typing import Iterable

import networkx as nx

from mokgen.compiler.ir.ops import Buffer, Op


class GraphBuilder:
    def __init__(self, buffers: Iterable[Buffer]):
        self.catalog = {b.name: b for b in buffers}
        self.g = nx.DiGraph()

    def add_op(self, op: Op, reads: Iterable[str], writes: Iterable[str]) -> Op:
        if op.name in self.g:
            raise ValueError(f"duplicate node name {op.name!r}")
        self.g.add_node(op.name, op=op)
        # Edge insertion order is kept by networkx, so predecessors()/successors() list the
        # operands in the order written here; to_text relies on that for readable listings.
        for name in reads:
            self._add_buffer(name)
            self.g.add_edge(name, op.name)
        for name in writes:
            self._add_buffer(name)
            self.g.add_edge(op.name, name)
        return op

    def _add_buffer(self, name: str) -> None:
        if name in self.g:
            if "buf" not in self.g.nodes[name]:
                raise ValueError(f"{name!r} is an op, not a buffer")
            return
        if name not in self.catalog:
            raise KeyError(f"buffer {name!r} is not declared")
        self.g.add_node(name, buf=self.catalog[name])


def topo_order(g: nx.DiGraph) -> list[str]:
    """All node names in topological order, ties broken by insertion order.

    Ops are added in the layer's pipeline order, so this listing is deterministic and reads
    like the math. The order is kept in the graph's attrs, which the passes' annotated copies
    inherit (they change ops, never edges): planning asks for it a few hundred times.
    """
    size = (g.number_of_nodes(), g.number_of_edges())
    cached = g.graph.get("topo_order")
    if cached is None or cached[0] != size:
        index = {n: i for i, n in enumerate(g.nodes)}
        cached = g.graph["topo_order"] = (
            size, tuple(nx.lexicographical_topological_sort(g, key=index.__getitem__)))
    return list(cached[1])
