"""Task-graph IR of the MoE layer: typed ops and buffers in a bipartite networkx DAG, whose
ops the passes annotate with their decisions."""
from mokgen.compiler.ir.annotate import annotate, common, gemm_ops, op_of, ring_ops
from mokgen.compiler.ir.graph import (GRAPH_DIRECTIONS, buffers, build_graph, comm_ops, ops, reads, validate,
                    writes)
from mokgen.compiler.ir.moe import P_NOTE, Dims
from mokgen.compiler.ir.ops import COMMS, DIRECTIONS, SPACES, Buffer, GemmConfig, Op, OpKind
from mokgen.compiler.ir.render import to_dot, to_text

__all__ = [
    "Buffer", "Op", "OpKind", "GemmConfig", "SPACES", "DIRECTIONS", "COMMS", "GRAPH_DIRECTIONS",
    "Dims", "P_NOTE",
    "build_graph", "ops", "comm_ops", "buffers", "reads", "writes", "validate",
    "to_text", "to_dot",
    "annotate", "common", "gemm_ops", "op_of", "ring_ops",
]
