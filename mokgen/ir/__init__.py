"""Task-graph IR of the MoE layer: typed ops and buffers in a bipartite networkx DAG, whose
ops the passes annotate with their decisions."""
from .annotate import annotate, common, gemm_ops, op_of, ring_ops
from .graph import (GRAPH_DIRECTIONS, buffers, build_graph, comm_ops, ops, reads, validate,
                    writes)
from .moe import P_NOTE, Dims
from .ops import COMMS, DIRECTIONS, SPACES, Buffer, GemmConfig, Op, OpKind
from .render import to_dot, to_text

__all__ = [
    "Buffer", "Op", "OpKind", "GemmConfig", "SPACES", "DIRECTIONS", "COMMS", "GRAPH_DIRECTIONS",
    "Dims", "P_NOTE",
    "build_graph", "ops", "comm_ops", "buffers", "reads", "writes", "validate",
    "to_text", "to_dot",
    "annotate", "common", "gemm_ops", "op_of", "ring_ops",
]
