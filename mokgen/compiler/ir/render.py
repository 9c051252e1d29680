"""Human-readable views of a task graph: a text listing and Graphviz DOT.

DOT is written by hand so the IR needs neither pydot nor graphviz installed; render the
output with any Graphviz (`dot -Tsvg`) when one is around.
"""
from __future__ import annotations

import networkx as nx

from mokgen.compiler.ir.builder import topo_order

# Space -> fill colour, so peer memory and the ring stand out from local scratch.
_SPACE_COLOR = {"local": "white", "peer": "lightblue", "ring": "palegreen"}
_COMM_COLOR = "orange"


def to_text(g: nx.DiGraph) -> str:
    """One line per op, `name [kind, comm]: inputs -> outputs` and, below it, its attrs
    (stage, and the decisions of the passes that annotated it), then the buffers."""
    order = topo_order(g)
    dims = " ".join(f"{k}={v}" for k, v in g.graph.get("dims", {}).items())
    lines = [f"# {g.graph.get('name', 'graph')}: {dims}"]
    lines += [f"# {k}: {note}" for k, note in g.graph.get("symbolic", {}).items()]
    if g.graph.get("inputs"):
        lines.append(f"# inputs:  {', '.join(g.graph['inputs'])}")
    if g.graph.get("outputs"):
        lines.append(f"# outputs: {', '.join(g.graph['outputs'])}")
    op_names = [n for n in order if "op" in g.nodes[n]]
    width = max((len(n) for n in op_names), default=0)
    lines.append("")
    for n in op_names:
        op = g.nodes[n]["op"]
        tag = op.direction + (f" comm={op.comm}" if op.comm else "")
        ins, outs = ", ".join(g.predecessors(n)), ", ".join(g.successors(n))
        lines.append(f"{n:<{width}}  [{tag}]  {ins} -> {outs}")
        # the passes' decisions (the builder's GEMM sizes are in the dims already)
        attrs = "; ".join(f"{k}={v}" for k, v in op.attrs if k not in ("gemms", "grouped_by"))
        if attrs:
            lines.append(f"{'':<{width}}    {attrs}")
    lines.append("")
    lines += [f"  {g.nodes[n]['buf']}" for n in order if "buf" in g.nodes[n]]
    return "\n".join(lines) + "\n"


def _q(s) -> str:
    """A DOT double-quoted string."""
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(g: nx.DiGraph) -> str:
    """Graphviz DOT: ops are boxes (comm ops filled and bold), buffers are ellipses."""
    name = g.graph.get("name", "task_graph")
    out = [f"digraph {_q(name)} {{", "  rankdir=TB;", '  node [fontname="Helvetica"];']
    for n in topo_order(g):
        data = g.nodes[n]
        if "op" in data:
            op = data["op"]
            kind = f"\n{op.kind.value}" if op.kind.value != n else ""
            label = f"{n}{kind}\n{op.direction}" + (f", comm: {op.comm}" if op.comm else "")
            style = (f'style="filled,bold", fillcolor={_COMM_COLOR}, penwidth=2'
                     if op.comm else "style=solid")
            out.append(f"  {_q(n)} [shape=box, {style}, label={_q(label)}];")
        else:
            buf = data["buf"]
            dims = ", ".join(str(d) for d in buf.shape)
            label = f"{n}\n[{dims}] {buf.dtype} {buf.space}"
            color = _SPACE_COLOR.get(buf.space, "white")
            out.append(f"  {_q(n)} [shape=ellipse, style=filled, fillcolor={color}, "
                       f"label={_q(label)}];")
    for u, v in g.edges:
        out.append(f"  {_q(u)} -> {_q(v)};")
    out.append("}")
    return "\n".join(out) + "\n"
