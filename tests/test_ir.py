"""Task-graph IR of the MoE layer (CPU only)."""
from __future__ import annotations

import re

import networkx as nx
import pytest

from mokgen.compiler.ir import (Buffer, Op, OpKind, build_graph, comm_ops, ops, reads, to_dot, to_text,
                       validate, writes)
from mokgen.shapes import MoEShape, get

SMALL = ["tiny", "small", "small-noshared", "gpu-small"]
MAIN = ["kimi-k2.7", "glm-5.2", "qwen3.5-397b-a17b", "deepseek-v4-pro"]


def _graph(name="small", ep=4, tokens=64, direction="both"):
    return build_graph(get(name), ep=ep, tokens=tokens, direction=direction)


def _kinds(g, direction=None):
    return [op.kind for op in ops(g, direction)]


def _op_of(g, kind):
    (op,) = [op for op in ops(g) if op.kind is kind]
    return op


# --- building -------------------------------------------------------------------------------

@pytest.mark.parametrize("direction", ["fwd", "bwd", "both"])
@pytest.mark.parametrize("name,ep", [(n, 2) for n in SMALL] + [(n, 8) for n in MAIN]
                         + [("kimi-k2.7", 64), ("tiny", 1)])
def test_builds_and_validates(name, ep, direction):
    g = build_graph(get(name), ep=ep, tokens=2048 if name in MAIN else 32, direction=direction)
    validate(g)
    assert nx.is_directed_acyclic_graph(g)
    assert nx.is_bipartite(g)
    assert g.graph["direction"] == direction


def test_buffer_shapes_are_concrete_except_routed_rows():
    shape = get("deepseek-v4-pro")
    g = build_graph(shape, ep=8, tokens=2048)
    L, D, I = 384 // 8, 7168, 3072
    buf = {n: d["buf"] for n, d in g.nodes(data=True) if "buf" in d}
    assert buf["x"].shape == (2048, D)
    assert buf["router_logits"].shape == (2048, 384)
    assert buf["w1"].shape == (L, 2 * I, D)
    assert buf["w2"].shape == (L, D, I)
    assert buf["route_table"].shape == (8, 2048, 6)
    assert buf["combine_buf"].shape == (2048, 6, D)
    assert buf["expert_offsets"].shape == (L + 1,)
    assert buf["x_ring"].shape == ("P", D)
    assert buf["h"].shape == ("P", I)
    # The only symbolic dim is the device-only routed-row count, and the graph says so.
    symbolic = {d for b in buf.values() for d in b.shape if isinstance(d, str)}
    assert symbolic == {"P"}
    assert "device" in g.graph["symbolic"]["P"]
    assert g.graph["p_bound"] == 8 * 2048 * 6
    assert g.graph["dims"] == dict(N=2048, D=D, I=I, I_s=I, E=384, L=L, k=6, R=8)


def test_buffer_spaces():
    g = _graph()
    space = {n: d["buf"].space for n, d in g.nodes(data=True) if "buf" in d}
    for n in ("x", "combine_buf", "route_table", "dy", "dx_parts"):
        assert space[n] == "peer", n
    for n in ("x_ring", "gate_up", "h", "y_ring", "dy_ring", "dx_ring"):
        assert space[n] == "ring", n
    assert space["w1"] == "local" and space["y"] == "local"


# --- communication ------------------------------------------------------------------------

def test_forward_comm_is_dispatch_then_combine():
    g = _graph(direction="fwd")
    assert [op.comm for op in comm_ops(g)] == ["dispatch", "combine"]
    assert all(op.direction == "fwd" for op in ops(g))


def test_backward_comm_is_reverse_combine_then_reverse_dispatch():
    g = _graph(direction="bwd")
    assert [op.comm for op in comm_ops(g)] == ["reverse_combine", "reverse_dispatch"]
    assert all(op.direction == "bwd" for op in ops(g))


def test_both_directions_have_all_four_comm_ops_in_order():
    g = _graph()
    assert [op.comm for op in comm_ops(g)] == [
        "dispatch", "combine", "reverse_combine", "reverse_dispatch"]
    assert _kinds(g) == _kinds(g, "fwd") + _kinds(g, "bwd")


# --- order and dataflow ----------------------------------------------------------------------

def test_forward_pipeline_order():
    order = _kinds(_graph(direction="fwd"))
    chain = [OpKind.ROUTE_TOPK, OpKind.ROUTE_ALLGATHER, OpKind.SCHEDULE_BUILD, OpKind.DISPATCH,
             OpKind.GATE_UP_GEMM, OpKind.SWIGLU, OpKind.DOWN_GEMM, OpKind.COMBINE,
             OpKind.WEIGHTED_SUM]
    positions = [order.index(k) for k in chain]
    assert positions == sorted(positions)


def test_forward_chain_is_a_dependency_not_just_an_order():
    g = _graph(direction="fwd")
    chain = ["route_topk", "schedule_build", "dispatch", "gate_up_gemm", "swiglu",
             "down_gemm", "combine", "weighted_sum"]
    for a, b in zip(chain, chain[1:]):
        assert nx.has_path(g, a, b), (a, b)


def test_backward_order():
    g = _graph(direction="bwd")
    order = [op.name for op in ops(g)]
    assert order.index("reverse_combine") < order.index("replay")
    assert order.index("down_dgrad") < order.index("swiglu_bwd_router_grad")
    assert order.index("swiglu_bwd_router_grad") < order.index("gate_up_dgrad")
    assert order.index("gate_up_dgrad") < order.index("reverse_dispatch")
    assert order.index("reverse_dispatch") < order.index("router_bwd")
    assert order.index("reverse_dispatch") < order.index("dx_sum")
    assert order[-1] == "dx_sum"


def test_router_grad_fusion_reads_activation_and_down_dgrad():
    g = _graph(direction="bwd")
    fused = _op_of(g, OpKind.SWIGLU_BWD_ROUTER_GRAD)
    down_dgrad = _op_of(g, OpKind.DOWN_DGRAD)
    (dh,) = writes(g, down_dgrad.name)
    assert "h_bwd" in reads(g, fused.name)  # the gated activation
    assert dh in reads(g, fused.name)
    assert "d_weights_ring" in writes(g, fused.name)
    # SonicMoE: no down-projection output is produced anywhere in the backward.
    assert "y_ring" not in g
    # The router-weight gradient flows back to the owner and into the logit gradient.
    assert nx.has_path(g, "d_weights_ring", "d_router_logits")


def test_gated_activation_comes_from_the_forward_or_replay():
    g = _graph()
    assert list(g.predecessors("h")) == ["swiglu"]
    assert list(g.predecessors("h_bwd")) == ["replay"]
    assert "h" in reads(g, "replay") and "gate_up" in reads(g, "replay")
    assert _op_of(g, OpKind.REPLAY).attr("only_lost_rows") is True


def test_shared_expert_does_not_depend_on_dispatch():
    g = _graph()
    for shared in ("shared_ffn", "shared_ffn_bwd"):
        for comm in comm_ops(g):
            assert not nx.has_path(g, comm.name, shared), (comm.name, shared)
    assert not nx.has_path(g, "route_topk", "shared_ffn")
    assert nx.has_path(g, "shared_ffn", "weighted_sum")
    assert nx.has_path(g, "shared_ffn_bwd", "dx_sum")


def test_no_shared_expert_drops_shared_ops():
    g = _graph("small-noshared")
    validate(g)
    kinds = set(_kinds(g))
    assert OpKind.SHARED_FFN not in kinds and OpKind.SHARED_FFN_BWD not in kinds
    assert not [n for n in g if n.startswith(("shared", "y_shared", "dx_shared", "d_shared"))]
    assert "shared_w1" not in g.graph["inputs"]
    with_shared = _graph("small")
    assert set(_kinds(with_shared)) - kinds == {OpKind.SHARED_FFN, OpKind.SHARED_FFN_BWD}


def test_every_op_kind_used_once_in_full_graph():
    assert sorted(_kinds(_graph()), key=lambda k: k.value) == sorted(OpKind,
                                                                    key=lambda k: k.value)


def test_inputs_outputs():
    g = _graph()
    assert set(g.graph["inputs"]) == {"x", "router_logits", "w1", "w2", "shared_w1",
                                      "shared_w2", "dy"}
    for n in g.graph["inputs"]:
        assert g.in_degree(n) == 0
    for n in g.graph["outputs"]:
        assert g.in_degree(n) == 1 and g.out_degree(n) == 0
    bwd = _graph(direction="bwd")
    assert set(g.graph["saved"]) <= set(bwd.graph["inputs"])


# --- rendering ------------------------------------------------------------------------------

def test_to_text_lists_every_op_with_operands():
    g = _graph()
    text = to_text(g)
    for op in ops(g):
        (line,) = [ln for ln in text.splitlines() if ln.startswith(op.name + " ")]
        ins, outs = line.split("]", 1)[1].split("->")
        assert [s.strip() for s in ins.split(",") if s.strip()] == reads(g, op.name)
        assert [s.strip() for s in outs.split(",")] == writes(g, op.name)


def _parse_dot(text):
    """A tiny DOT reader for what to_dot writes: quoted ids, one statement per line."""
    assert re.match(r'^digraph "[^"]*" \{', text)
    assert text.rstrip().endswith("}")
    nodes, edges = {}, set()
    for line in text.splitlines()[1:-1]:
        if m := re.fullmatch(r'\s*"([^"]+)" -> "([^"]+)";', line):
            edges.add(m.groups())
        elif m := re.fullmatch(r'\s*"([^"]+)" \[(.*)\];', line):
            nodes[m.group(1)] = m.group(2)
    return nodes, edges


def test_to_dot_is_dot_with_every_node_and_edge():
    g = _graph()
    text = to_dot(g)
    assert text.startswith("digraph")
    assert text.count("{") == text.count("}") == 1
    nodes, edges = _parse_dot(text)
    assert set(nodes) == set(g.nodes)
    assert edges == set(g.edges)
    for op in ops(g):
        assert "shape=box" in nodes[op.name]
        assert ("fillcolor=orange" in nodes[op.name]) == (op.comm is not None)
    assert "shape=ellipse" in nodes["x"]


# --- validation -----------------------------------------------------------------------------

def test_validate_rejects_a_cycle():
    g = _graph(direction="fwd")
    g.add_edge("y", "route_topk")
    with pytest.raises(ValueError, match="cycle"):
        validate(g)


def test_validate_rejects_unwritten_read():
    g = _graph(direction="fwd")
    g.add_node("ghost", buf=Buffer("ghost", (4,), "fp32"))
    g.add_edge("ghost", "down_gemm")
    with pytest.raises(ValueError, match="ghost.*nothing writes"):
        validate(g)


def test_validate_rejects_op_to_op_edge_and_double_writer():
    g = _graph(direction="fwd")
    g.add_edge("swiglu", "down_gemm")
    with pytest.raises(ValueError, match="op to op"):
        validate(g)
    g = _graph(direction="fwd")
    g.add_edge("route_topk", "y")
    with pytest.raises(ValueError, match="several writers"):
        validate(g)


def test_backward_alone_needs_saved_inputs():
    g = _graph(direction="bwd")
    g.graph["inputs"] = tuple(n for n in g.graph["inputs"] if n != "gate_up")
    with pytest.raises(ValueError, match="gate_up"):
        validate(g)


# --- types and argument checks --------------------------------------------------------------

def test_op_and_buffer_checks():
    op = Op("d", OpKind.DISPATCH, "fwd", "dispatch", {"b": 2, "a": 1})
    assert op.attrs == (("a", 1), ("b", 2)) and op.attr("b") == 2
    hash(op)
    with pytest.raises(ValueError, match="comm"):
        Op("d", OpKind.DISPATCH, "fwd", None)
    with pytest.raises(ValueError, match="direction"):
        Op("g", OpKind.GATE_UP_GEMM, "bwd")
    with pytest.raises(ValueError, match="space"):
        Buffer("b", (1,), "bf16", "remote")
    with pytest.raises(ValueError, match="dims"):
        Buffer("b", (0, "P"), "bf16")


def test_build_graph_argument_errors():
    shape = get("small")
    with pytest.raises(ValueError, match="ep"):
        build_graph(shape, ep=3, tokens=16)
    with pytest.raises(ValueError, match="tokens"):
        build_graph(shape, ep=2, tokens=0)
    with pytest.raises(ValueError, match="direction"):
        build_graph(shape, ep=2, tokens=16, direction="up")
    with pytest.raises(TypeError, match="MoEShape"):
        build_graph("small", ep=2, tokens=16)
    with pytest.raises(ValueError, match="direction"):
        ops(_graph(), "sideways")


def test_shared_intermediate_is_used():
    shape = MoEShape(8, 64, 32, 2, shared_intermediate=48)
    g = build_graph(shape, ep=2, tokens=16)
    assert g.nodes["shared_w2"]["buf"].shape == (64, 48)
    assert g.nodes["shared_gate_up"]["buf"].shape == (16, 96)
