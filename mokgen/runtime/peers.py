"""Who the peers are and where their writable buffers live.

A peer buffer is one that other ranks write into (the gathered route table, the combine rows)
or read from (x). Kernels address peers through tables of R device pointers passed by value.
- virtual ranks: all R ranks' buffers live on this GPU; the stream orders the ranks' kernels,
  so barriers are no-ops.
- real ranks: buffers come from torch.distributed._symmetric_memory (rendezvous gives every
  rank's address); barriers are unicast epoch flags (never NVLink multicast).
"""
from __future__ import annotations

import struct

import torch

KINDS = ("routes", "weights", "combine", "x", "dy", "dweight", "flags", "xq")
STAGED = ("x", "dy")  # callers' tensors, staged in symmetric memory by real ranks only


def peer_shapes(spec) -> dict:
    """kind -> (shape, dtype) of one rank's peer buffers."""
    R, N, K = spec.ep, spec.tokens_per_rank, spec.topk
    return {"routes": ((R, N * K), torch.int32), "weights": ((R, N * K), torch.float32),
            "combine": ((combine_rows(spec), spec.hidden), torch.bfloat16),
            "x": ((N, spec.hidden), torch.bfloat16), "dy": ((N, spec.hidden), torch.bfloat16),
            "dweight": ((N * K,), torch.float32), "flags": ((R,), torch.int32),
            # fp8 plans: the owner's quantized tokens, e4m3 [N, D] then fp32 scales [N, ceil(D/Q)]
            "xq": ((max(16, xq_bytes(spec)),), torch.uint8)}


def combine_rows(spec) -> int:
    """Rows of the combine buffer: the T k routed rows, or, where the backward's dy ring is
    these rows (`LayerSpec.dx_ring`), as many as that ring: the forward's rows
    are dead once summed."""
    n = spec.tokens_per_rank * spec.topk
    return max(n, spec.macrobatch) if spec.dx_ring else n


def xq_bytes(spec) -> int:
    q, N, D = spec.scale_block, spec.tokens_per_rank, spec.hidden
    return N * D + 4 * N * -(-D // q) if q else 0


class PeerSet:
    def __init__(self, spec, dev, virtual: bool, group=None):
        self.spec, self.virtual = spec, virtual
        self.epoch = 0
        shapes = peer_shapes(spec)
        if virtual:  # callers' x tensors are read in place: no staging buffers for x
            self.hosted_ranks = list(range(spec.ep))
            self.bufs = {k: [torch.empty(*shapes[k][0], dtype=shapes[k][1], device=dev)
                             for _ in self.hosted_ranks] for k in KINDS if k not in STAGED}
            self.ptrs = {k: [t.data_ptr() for t in v] for k, v in self.bufs.items()}
            for t in self.bufs["flags"]:  # barrier epochs start at 0 (used by tests here)
                t.zero_()
            return
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm

        group = group or dist.group.WORLD
        if dist.get_world_size(group) != spec.ep:
            raise ValueError(f"ep ({spec.ep}) must equal the process group size "
                             f"({dist.get_world_size(group)}) unless virtual=True")
        self.hosted_ranks = [dist.get_rank(group)]
        self.bufs, self.ptrs, self._handles = {}, {}, []
        for k in KINDS:
            t = symm.empty(*shapes[k][0], dtype=shapes[k][1], device=dev)
            if k == "flags":
                t.zero_()
            h = symm.rendezvous(t, group=group.group_name)
            self._handles.append(h)
            self.bufs[k] = [t]
            self.ptrs[k] = [int(p) for p in h.buffer_ptrs]
        dist.barrier(group)  # zeroed flags are visible before any peer's first barrier

    def local(self, hosted_index: int) -> dict:
        return {k: v[hosted_index] for k, v in self.bufs.items()}

    def table(self, kind: str) -> bytes:
        return struct.pack(f"<{len(self.ptrs[kind])}Q", *self.ptrs[kind])

    def x_pointers(self, xs, kind: str = "x") -> list:
        """Where each rank's x (or dy, kind="dy") is readable. Virtual ranks read the callers'
        tensors directly; a real rank stages its own in symmetric memory (peers can only read
        that)."""
        if self.virtual:
            return [x.data_ptr() for x in xs]
        self.bufs[kind][0][: xs[0].shape[0]].copy_(xs[0])
        return self.ptrs[kind]

    def barrier(self, launch_barrier) -> None:
        """All ranks reach this point on their streams. `launch_barrier(epoch)` launches the
        device-side barrier kernel; virtual ranks share one stream, which already orders them."""
        if self.virtual:
            return
        self.epoch += 1
        launch_barrier(self.epoch)
