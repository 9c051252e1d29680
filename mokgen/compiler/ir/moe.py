"""The MoE layer, forward and backward, written as ops over named buffers.

Everything is per rank. Buffers are single-assignment (one writer each), so the graph is a
plain dataflow DAG: a buffer the backward recomputes gets a new name (gate_up -> gate_up_bwd)
instead of a second writer.

Dims: N tokens of this rank, D hidden, I expert width, I_s shared width, E experts,
L = E/ep local experts, k routes per token, R = ep ranks, and the symbolic P (see P_NOTE).
"""
from __future__ import annotations

from dataclasses import dataclass

from mokgen.shapes import MoEShape

from mokgen.compiler.ir.builder import GraphBuilder
from mokgen.compiler.ir.ops import Buffer, Op, OpKind

P = "P"
P_NOTE = ("rows routed to this rank's experts; data-dependent, known only on the device "
          "(never copied to the host), P <= R*N*min(k, L)")

# Activations are bf16 with fp32 accumulation (design: Precision); the precision pass may
# retype them. Router math is fp32 throughout, indices int32.
ACT, F32, IDX = "bf16", "fp32", "int32"


@dataclass(frozen=True)
class Dims:
    N: int
    D: int
    I: int
    I_s: int
    E: int
    L: int
    k: int
    R: int

    @classmethod
    def of(cls, shape: MoEShape, ep: int, tokens: int) -> "Dims":
        return cls(N=tokens, D=shape.hidden, I=shape.intermediate, I_s=shape.shared_dim,
                   E=shape.num_experts, L=shape.local_experts(ep), k=shape.topk, R=ep)

    def p_bound(self) -> int:
        # Every rank sends each token at most once per selected expert on this rank.
        return self.R * self.N * min(self.k, self.L)


def buffers(d: Dims, shared: bool) -> list[Buffer]:
    bufs = [
        # layer inputs
        Buffer("x", (d.N, d.D), ACT, "peer"),  # peer: dispatch (and replay refill) pull rows
        Buffer("router_logits", (d.N, d.E), F32),
        Buffer("w1", (d.L, 2 * d.I, d.D), ACT),  # rows 0:I gate, I:2I up
        Buffer("w2", (d.L, d.D, d.I), ACT),
        # routing, before the megakernel
        Buffer("topk_ids", (d.N, d.k), IDX),
        # peer: the expert's rank pulls the weight with dy in reverse_combine
        Buffer("topk_weights", (d.N, d.k), F32, "peer"),
        Buffer("route_table", (d.R, d.N, d.k), IDX, "peer"),  # every rank's topk_ids
        # Algorithm 1: row p = (src_rank, src_index); experts own contiguous row ranges
        Buffer("schedule", (P, 2), IDX),
        Buffer("expert_offsets", (d.L + 1,), IDX),
        # routed expert FFN, one row per routed (token, expert) pair
        Buffer("x_ring", (P, d.D), ACT, "ring"),
        Buffer("gate_up", (P, 2 * d.I), ACT, "ring"),  # pre-activation, saved for backward
        Buffer("h", (P, d.I), ACT, "ring"),  # gated activation silu(gate) * up
        Buffer("y_ring", (P, d.D), ACT, "ring"),
        Buffer("combine_buf", (d.N, d.k, d.D), ACT, "peer"),  # slot per route: no atomics
        Buffer("y", (d.N, d.D), ACT),
        # backward
        Buffer("dy", (d.N, d.D), ACT, "peer"),
        Buffer("dy_ring", (P, d.D), ACT, "ring"),
        Buffer("weights_ring", (P,), F32, "ring"),
        Buffer("x_ring_bwd", (P, d.D), ACT, "ring"),
        Buffer("gate_up_bwd", (P, 2 * d.I), ACT, "ring"),
        Buffer("h_bwd", (P, d.I), ACT, "ring"),
        Buffer("dh", (P, d.I), ACT, "ring"),  # dy_row @ W_down, not yet router-weighted
        Buffer("d_gate_up", (P, 2 * d.I), ACT, "ring"),
        Buffer("d_weights_ring", (P,), F32, "ring"),
        Buffer("dx_ring", (P, d.D), ACT, "ring"),
        Buffer("dx_parts", (d.N, d.k, d.D), ACT, "peer"),
        Buffer("d_topk_weights", (d.N, d.k), F32, "peer"),
        Buffer("dw1", (d.L, 2 * d.I, d.D), ACT),
        Buffer("dw2", (d.L, d.D, d.I), ACT),
        Buffer("d_router_logits", (d.N, d.E), F32),
        Buffer("dx", (d.N, d.D), ACT),
    ]
    if shared:
        bufs += [
            Buffer("shared_w1", (2 * d.I_s, d.D), ACT),
            Buffer("shared_w2", (d.D, d.I_s), ACT),
            Buffer("shared_gate_up", (d.N, 2 * d.I_s), ACT),  # saved for backward
            Buffer("y_shared", (d.N, d.D), ACT),
            Buffer("dx_shared", (d.N, d.D), ACT),
            Buffer("d_shared_w1", (2 * d.I_s, d.D), ACT),
            Buffer("d_shared_w2", (d.D, d.I_s), ACT),
        ]
    return bufs


def _op(kind: OpKind, **attrs) -> Op:
    return Op(kind.value, kind, kind.direction, kind.comm, attrs)


def _gemm(m, n, k) -> dict:
    # (M, N, K) per GEMM, K the reduction; lets the cost model count FLOPs. Grouped GEMMs
    # split M (or K, for weight grads) into the experts' row ranges of expert_offsets.
    return {"gemms": ((m, n, k),), "grouped_by": "expert"}


def add_forward(b: GraphBuilder, d: Dims, shared: bool) -> None:
    K = OpKind
    # Prologue (before the megakernel): routing never leaves the device.
    b.add_op(_op(K.ROUTE_TOPK, stage="prologue"),
             ["router_logits"], ["topk_ids", "topk_weights"])
    b.add_op(_op(K.ROUTE_ALLGATHER, stage="prologue"), ["topk_ids"], ["route_table"])
    b.add_op(_op(K.SCHEDULE_BUILD, stage="prologue"),
             ["route_table"], ["schedule", "expert_offsets"])
    # Megakernel.
    b.add_op(_op(K.DISPATCH, stage="megakernel"), ["x", "schedule"], ["x_ring"])
    if shared:
        # Reads only local x, so it can fill the first dispatch window.
        b.add_op(_op(K.SHARED_FFN, stage="megakernel",
                     gemms=((d.N, 2 * d.I_s, d.D), (d.N, d.D, d.I_s))),
                 ["x", "shared_w1", "shared_w2"], ["y_shared", "shared_gate_up"])
    b.add_op(_op(K.GATE_UP_GEMM, stage="megakernel", **_gemm(P, 2 * d.I, d.D)),
             ["x_ring", "w1", "expert_offsets"], ["gate_up"])
    b.add_op(_op(K.SWIGLU, stage="megakernel"), ["gate_up"], ["h"])
    b.add_op(_op(K.DOWN_GEMM, stage="megakernel", **_gemm(P, d.D, d.I)),
             ["h", "w2", "expert_offsets"], ["y_ring"])
    b.add_op(_op(K.COMBINE, stage="megakernel"), ["y_ring", "schedule"], ["combine_buf"])
    # Owner side: sums its k slots in route order (deterministic), weights applied here.
    b.add_op(_op(K.WEIGHTED_SUM, stage="megakernel"),
             ["combine_buf", "topk_weights"] + (["y_shared"] if shared else []), ["y"])


def add_backward(b: GraphBuilder, d: Dims, shared: bool) -> None:
    K = OpKind
    # Pull dy rows and router weights per ring row; rows the forward ring overwrote also get
    # their x row re-pulled here (same table, same direction), so replay itself stays local.
    b.add_op(_op(K.REVERSE_COMBINE, stage="megakernel"),
             ["dy", "topk_weights", "x", "x_ring", "schedule"],
             ["dy_ring", "weights_ring", "x_ring_bwd"])
    # Recompute gate/up (+ SwiGLU epilogue) only outside the window that survived in the ring.
    b.add_op(_op(K.REPLAY, stage="megakernel", only_lost_rows=True, **_gemm(P, 2 * d.I, d.D)),
             ["x_ring_bwd", "gate_up", "h", "w1", "expert_offsets"], ["gate_up_bwd", "h_bwd"])
    b.add_op(_op(K.DOWN_DGRAD, stage="megakernel", **_gemm(P, d.I, d.D)),
             ["dy_ring", "w2", "expert_offsets"], ["dh"])
    # SonicMoE: d(weight) = <h, dh>, so the down-projection output is never materialized;
    # the weight is applied to dh only after that inner product.
    b.add_op(_op(K.SWIGLU_BWD_ROUTER_GRAD, stage="megakernel"),
             ["h_bwd", "dh", "gate_up_bwd", "weights_ring"], ["d_gate_up", "d_weights_ring"])
    b.add_op(_op(K.GATE_UP_DGRAD, stage="megakernel", **_gemm(P, d.D, 2 * d.I)),
             ["d_gate_up", "w1", "expert_offsets"], ["dx_ring"])
    b.add_op(_op(K.REVERSE_DISPATCH, stage="megakernel"),
             ["dx_ring", "d_weights_ring", "schedule"], ["dx_parts", "d_topk_weights"])
    # Weight grads reduce over the rows of each expert: M, N the weight, K = P.
    b.add_op(_op(K.WEIGHT_GRAD_W1, stage="megakernel", **_gemm(2 * d.I, d.D, P)),
             ["d_gate_up", "x_ring_bwd", "expert_offsets"], ["dw1"])
    b.add_op(_op(K.WEIGHT_GRAD_W2, stage="megakernel", **_gemm(d.D, d.I, P)),
             ["dy_ring", "h_bwd", "weights_ring", "expert_offsets"], ["dw2"])
    if shared:
        gemms = ((d.N, d.I_s, d.D), (d.N, d.D, 2 * d.I_s),  # dgrad: down, gate/up
                 (d.D, d.I_s, d.N), (2 * d.I_s, d.D, d.N))  # wgrad: w2, w1
        b.add_op(_op(K.SHARED_FFN_BWD, stage="megakernel", gemms=gemms),
                 ["dy", "x", "shared_gate_up", "shared_w1", "shared_w2"],
                 ["dx_shared", "d_shared_w1", "d_shared_w2"])
    b.add_op(_op(K.ROUTER_BWD, stage="megakernel"),
             ["d_topk_weights", "topk_ids", "topk_weights", "router_logits"],
             ["d_router_logits"])
    b.add_op(_op(K.DX_SUM, stage="megakernel"),
             ["dx_parts"] + (["dx_shared"] if shared else []), ["dx"])


def inputs(direction: str, shared: bool) -> list[str]:
    """Buffers the caller provides (no op writes them)."""
    weights = ["w1", "w2"] + (["shared_w1", "shared_w2"] if shared else [])
    fwd = ["x", "router_logits"] + weights
    if direction == "fwd":
        return fwd
    if direction == "both":
        return fwd + ["dy"]
    return fwd + ["dy"] + saved(shared)


def saved(shared: bool) -> list[str]:
    """Forward buffers the backward reads (besides the layer inputs)."""
    return (["topk_ids", "topk_weights", "schedule", "expert_offsets", "x_ring", "gate_up", "h"]
            + (["shared_gate_up"] if shared else []))


def outputs(direction: str, shared: bool) -> list[str]:
    fwd = ["y"]
    bwd = ["dx", "d_router_logits", "dw1", "dw2"] + (
        ["d_shared_w1", "d_shared_w2"] if shared else [])
    return {"fwd": fwd, "bwd": bwd, "both": fwd + bwd}[direction]
