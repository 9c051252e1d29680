"""The prologue's kernels alone: routing and the schedule (Algorithm 1) of a plan, built and
run with no megakernel, on R virtual ranks' buffers sized as the runtime sizes them. For the
GPU tests of the schedule (tests/test_gpu_prologue.py)."""
from __future__ import annotations

import torch

from mokgen.compiler import build, codegen
from mokgen.compiler.lower import layer_spec
from mokgen.compiler.plan import Plan


class StandalonePrologue:
    def __init__(self, plan: Plan):
        from mokgen.runtime import cuda
        from mokgen.runtime.peers import PeerSet
        from mokgen.runtime.prologue import Prologue
        from mokgen.runtime.workspace import BackwardScratch, RankBuffers

        self.plan, self.spec = plan, layer_spec(plan)
        s = self.spec
        [binary] = build.build(codegen.emit(plan, units=("prologue",)))
        self.module = cuda.load_module(binary.image)  # kept: the functions live in it
        self.kernels = Prologue(self.module, s.local_experts, s.topk)
        self.dev = torch.device("cuda", torch.cuda.current_device())
        self.peers = PeerSet(s, self.dev, virtual=True)
        self.ranks = [RankBuffers(s, self.dev, self.peers.local(i)) for i in range(s.ep)]
        self.bwd = BackwardScratch(s, self.dev)  # the segments' tables

    @property
    def stream(self):
        return torch.cuda.current_stream(self.dev)

    def tables(self):
        from mokgen.runtime import cuda

        return cuda.Raw(self.peers.table("routes") + self.peers.table("weights"))

    def set_routes(self, routes: torch.Tensor, weights: torch.Tensor) -> None:
        """Every rank's gathered tables as route_given leaves them: routes int [R, n*k] global
        experts, weights fp32 [R, n*k] (packed at n*k per source rank)."""
        for b in self.ranks:
            b.routes.view(-1)[: routes.numel()] = routes.flatten().to(torch.int32)
            b.weights.view(-1)[: weights.numel()] = weights.flatten().float()

    def route(self, rank: int, logits: torch.Tensor) -> None:
        self.kernels.route(self.stream, logits, logits.shape[0], rank, self.tables())

    def schedule(self, rank: int, n: int) -> None:
        self.kernels.schedule(self.stream, self.ranks[rank], n, self.spec.ep, rank)

    def segments(self, rank: int) -> None:
        b = self.ranks[rank]
        self.kernels.segments(self.stream, b, self.spec.ep, self.bwd.segs, self.bwd.seg_start)
