"""The tile of each GEMM op: BM x BN outputs per CTA tile and the K-slices in flight
(gemm_types.cuh GemmCfg). Codegen instantiates one tile engine per kernel from its ops' tiles;
the granularity pass sizes minibatches in whole BM tiles.

The default is the one configuration the kernels are tuned for (mokgen.compiler.limits.DEFAULT_GEMM);
`gemm_fwd` / `gemm_bwd` force the tile of every GEMM op of a direction (mokgen.compiler.limits says
which the kernels implement)."""
from __future__ import annotations

from mokgen.compiler import ir
from mokgen.compiler.limits import DEFAULT_GEMM


def tiling(g):
    """Annotates every GEMM op with its `gemm` (an ir.GemmConfig)."""
    forced = g.graph["problem"]["overrides"]
    return ir.annotate(g, {op.name: {"gemm": forced.get(f"gemm_{op.direction}", DEFAULT_GEMM)}
                           for op in ir.gemm_ops(g)})
