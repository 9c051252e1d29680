"""The prologue's routing and schedule kernels (route.cuh, schedule.cuh), launched on one
rank's buffers. The forward runtime launches them before its megakernel; the schedule's tests
load the prologue cubin alone and run them with no megakernel built.
"""
from __future__ import annotations

import struct

from mokgen.runtime import abi, cuda


def warp_per_token_grid(n: int) -> int:
    """Blocks of 256 threads for a kernel that gives each token a warp (route.cuh's routing
    and router backward, fp8.cuh's quantization of x): 8 tokens a block, at most 1,024 blocks
    (the kernels stride over the rest)."""
    return max(1, min(1024, -(-n // 8)))


class Prologue:
    def __init__(self, module, local_experts: int, topk: int):
        chunk = struct.unpack("<i", cuda.read_global(module, "mokgen_sched_chunk"))[0]
        if chunk != abi.SCHED_CHUNK:
            raise RuntimeError(f"mokgen: the prologue's count kernel takes {chunk} routes per "
                               f"block, this runtime sizes for {abi.SCHED_CHUNK} (a cubin "
                               f"built by another mokgen version)")
        self.module = module  # fp8 plans: also the weight quantizers (runtime/weight_quant.py)
        self.L, self.K = local_experts, topk
        self.f_route = module.function("mokgen_route")
        self.f_route_given = module.function("mokgen_route_given")
        self.f_router_bwd = module.function("mokgen_router_bwd")
        self.count_smem = struct.unpack(
            "<i", cuda.read_global(module, "mokgen_sched_count_smem"))[0]
        self.f_count = module.function("mokgen_sched_count", self.count_smem)
        self.f_offsets = module.function("mokgen_sched_offsets")
        self.f_place = module.function("mokgen_sched_place")
        self.f_segments = module.function("mokgen_sched_segments")

    def route(self, st, logits, n, rank, tables) -> None:
        """Softmax top-k of a rank's n tokens, written into every rank's gathered tables
        (`tables`: RouteTables<R> by value)."""
        cuda.launch(self.f_route, warp_per_token_grid(n), 256, 0, st,
                    [logits, n, rank, tables])

    def route_given(self, st, experts, weights, n, rank, tables) -> None:
        """The caller's routes of a rank's n tokens, written into every rank's tables."""
        total = n * self.K
        cuda.launch(self.f_route_given, max(1, min(1024, -(-total // 256))), 256, 0, st,
                    [experts, weights, n, rank, tables])

    def router_backward(self, st, logits, experts, dweights, out) -> None:
        """out [n, E] fp32 = the gradient of fp32 logits [n, E] from the router weights'
        dweights [n, k] fp32 of the routes experts [n, k] int32 (route.cuh
        router_backward_tokens)."""
        n = logits.shape[0]
        cuda.launch(self.f_router_bwd, warp_per_token_grid(n), 256, 0, st,
                    [logits, experts, dweights, out, n])

    # Algorithm 1 for rank `rank` from its gathered routes (b: RankBuffers), n tokens per rank
    # over `ranks` ranks: count, offsets, place, back to back on the stream.
    def schedule(self, st, b, n, ranks, rank) -> None:
        self.count(st, b, n, ranks, rank)
        self.offsets(st, b, n, ranks)
        self.place(st, b, n, ranks, rank)

    def count(self, st, b, n, ranks, rank) -> None:
        rpr = n * self.K
        cuda.launch(self.f_count, (abi.sched_chunks(rpr), ranks), abi.SCHED_CHUNK,
                    self.count_smem, st,
                    [b.routes, rpr, rank, b.ordinal, b.chunk_counts])

    def offsets(self, st, b, n, ranks) -> None:
        cuda.launch(self.f_offsets, 1, 1024, 0, st,
                    [b.chunk_counts, ranks, abi.sched_chunks(n * self.K), b.counts, b.offsets,
                     b.meta, b.table])

    def place(self, st, b, n, ranks, rank) -> None:
        rpr = n * self.K
        cuda.launch(self.f_place, max(1, min(4096, -(-ranks * rpr // 256))), 256, 0, st,
                    [b.routes, b.weights, rpr, ranks, rank, b.ordinal, b.chunk_counts,
                     abi.sched_chunks(rpr), b.counts, b.offsets, b.table, b.row_weight])

    def segments(self, st, b, ranks, segs, seg_start) -> None:
        """The backward's weight-gradient segments from rank buffers b's schedule (its
        offsets, per-source counts and row count; `ranks` sources)."""
        cuda.launch(self.f_segments, 1, 32, 0, st,
                    [b.offsets, b.counts, ranks, b.meta, segs, seg_start])
