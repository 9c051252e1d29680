"""The backward layer at run time: launches the backward megakernel on the forward runtime's
buffers (its rings, schedule and peer tables), on the current torch stream, no host sync.

Ring-aware replay: when the rings still hold the forward being differentiated (nothing ran
on this layer in between, and that forward kept its gate/up pre-activations), the kernel
takes macrobatch 0 from the ring and replays only the rest; otherwise it re-schedules from
the saved routes and replays everything. Either way the gradients are the same.
"""
from __future__ import annotations

import struct

import torch

from . import cuda

BF16 = torch.bfloat16


class BackwardPass:
    def __init__(self, rt, bwd_cubin: str):
        self.rt = rt
        s = rt.spec
        mod = cuda.load_module(bwd_cubin)
        rt.adopt_module(mod)
        self.smem = struct.unpack("<i", cuda.read_global(mod, "mokgen_bwd_smem_bytes"))[0]
        # the kernel's tile counts (bwd.cu.j2): dgrad tiles across I, weight-gradient tiles
        # per expert; the host sizes dw_part and the counters by them
        self.dg_tiles, self.wg_tiles = struct.unpack(
            "<2i", cuda.read_global(mod, "mokgen_bwd_tiles"))
        self.f_bwd = mod.function("mokgen_bwd", self.smem)
        self.f_segments = rt.modules[0].function("mokgen_sched_segments")
        dev, M, D, I, N = rt.dev, s.macrobatch, s.hidden, s.intermediate, s.tokens_per_rank
        IS, L = max(s.shared_dim, 64), s.local_experts
        e = dict(dtype=BF16, device=dev)
        # scratch shared by the hosted ranks: their kernels run one after another
        self.ring_dy = torch.empty(M, D, **e)
        self.ring_do = torch.empty(M, D, **e)
        self.ring_dh = torch.empty(M, 2 * I, **e)
        self.dw_part = torch.empty(s.max_rows, self.dg_tiles, dtype=torch.float32, device=dev)
        self.hs_pre = torch.empty(N, 2 * IS, **e)
        self.hs_a = torch.empty(N, IS, **e)
        self.hs_dh = torch.empty(N, 2 * IS, **e)
        self.wg_acc = torch.empty(L, 3 * I * D, dtype=torch.float32, device=dev)
        self.segs = torch.empty(s.max_minibatches + L, 4, dtype=torch.int32, device=dev)
        self.seg_start = torch.empty(s.max_minibatches + 2, dtype=torch.int32, device=dev)
        self.counters = torch.empty(self.counter_words(), dtype=torch.int32, device=dev)
        q = s.scale_block
        if q:  # the fp8 backward's e4m3 rings of dy and dh and their scales [K/q, M]
            u8, f32 = dict(dtype=torch.uint8, device=dev), dict(dtype=torch.float32, device=dev)
            self.ring_dy8, self.ring_sdy = torch.empty(M, D, **u8), torch.empty(D // q, M, **f32)
            self.ring_dh8 = torch.empty(M, 2 * I, **u8)
            self.ring_sdh = torch.empty(2 * I // q, M, **f32)

    def counter_words(self) -> int:
        s = self.rt.spec
        mb, rt_full = s.max_minibatches, s.minibatch // s.block_m
        srt = -(-s.tokens_per_rank // s.block_m)
        return 1 + mb * (2 + 2 * rt_full) + s.local_experts * self.wg_tiles + 2 * srt + 2

    def poison(self) -> None:
        for t in (self.ring_dy, self.ring_do, self.ring_dh, self.dw_part, self.hs_pre, self.hs_a,
                  self.hs_dh, self.wg_acc):
            t.fill_(float("nan"))
        if self.rt.spec.scale_block:
            self.ring_dy8.fill_(0xFF)  # e4m3 NaN
            self.ring_dh8.fill_(0xFF)
            self.ring_sdy.fill_(float("nan"))
            self.ring_sdh.fill_(float("nan"))
        for b in self.rt.ranks:
            b.dweight.fill_(float("nan"))

    # ------------------------------------------------------------------ the call
    def backward(self, dys, xs, w1s, w2s, shared_w1, shared_w2, routes, generation):
        """Per hosted rank lists. `routes`: per hosted rank (experts int32 [n, k] global ids,
        weights fp32 [n, k]) of the forward being differentiated; `generation`: that
        forward's `rt.generation`. Returns (dxs, dweights [n, k] fp32, dw1s, dw2s, dsw1,
        dsw2); the shared gradients are summed over the hosted ranks (None without one)."""
        rt, s = self.rt, self.rt.spec
        n = xs[0].shape[0]
        hosted = range(len(rt.ranks))
        resident = rt.saved and generation == rt.generation
        rt.generation += 1  # the backward's pulls overwrite the rings
        rt.saved = False
        # staged x and dy, and every rank done reading its combine rows (the dx rows reuse
        # them), before any rank's kernel touches a peer
        x_ptrs = rt.peers.x_pointers(xs)
        dy_ptrs = rt.peers.x_pointers(dys, "dy")
        if not resident:  # the tables were rewritten since: rebuild them from the routes
            for i in hosted:
                rt.route_given(i, *routes[i], n)
        rt.peers.barrier(rt._launch_barrier)
        if not resident:
            for i in hosted:
                rt.schedule(i, n)
        dw1s = [rt.output(tuple(w.shape), BF16) for w in w1s]
        dw2s = [rt.output(tuple(w.shape), BF16) for w in w2s]
        dsw = [[rt.output(tuple(w.shape), BF16) for w in (shared_w1, shared_w2)]
               if shared_w1 is not None else [None, None] for _ in hosted]
        for i in hosted:
            self._launch(i, n, xs[i], dys[i], x_ptrs, dy_ptrs, w1s[i], w2s[i], shared_w1,
                         shared_w2, dw1s[i], dw2s[i], *dsw[i], resident)
        rt.peers.barrier(rt._launch_barrier)
        dxs = [rt.combine_sum(i, n) for i in hosted]
        dweights = [rt.ranks[i].dweight[: n * s.topk].view(n, s.topk).clone() for i in hosted]
        # the shared expert's gradients: every hosted rank's tokens, summed in rank order
        dsw1, dsw2 = (None if shared_w1 is None else _sum([d[j] for d in dsw]) for j in (0, 1))
        return dxs, dweights, dw1s, dw2s, dsw1, dsw2

    def backward_rank(self, i, dys, xs, w1s, w2s, shared_w1, shared_w2):
        """Hosted rank i's own backward alone (segments, megakernel, its dx sum) right after
        its forward_rank(save=True), reusing the other ranks' buffers from an earlier full
        call: the per-rank slice that benchmarks time. -> (dx, dw1, dw2, dsw1, dsw2)."""
        rt, n = self.rt, xs[0].shape[0]
        resident = rt.saved
        rt.generation += 1
        rt.saved = False
        dw1, dw2 = torch.empty_like(w1s[i]), torch.empty_like(w2s[i])
        dsw1 = None if shared_w1 is None else torch.empty_like(shared_w1)
        dsw2 = None if shared_w2 is None else torch.empty_like(shared_w2)
        self._launch(i, n, xs[i], dys[i], rt.peers.x_pointers(xs),
                     rt.peers.x_pointers(dys, "dy"), w1s[i], w2s[i], shared_w1, shared_w2, dw1,
                     dw2, dsw1, dsw2, resident)
        return rt.combine_sum(i, n), dw1, dw2, dsw1, dsw2

    def _launch(self, i, n, x, dy, x_ptrs, dy_ptrs, w1, w2, sw1, sw2, dw1, dw2, dsw1, dsw2,
                resident):
        rt, s, b = self.rt, self.rt.spec, self.rt.ranks[i]
        st = rt._stream()
        cuda.launch(self.f_segments, 1, 32, 0, st,
                    [b.offsets, b.meta, self.segs, self.seg_start])
        self.counters.zero_()
        L, D, I, M = s.local_experts, s.hidden, s.intermediate, s.macrobatch
        IS = self.hs_a.shape[1]
        sw1 = sw1 if sw1 is not None else self.hs_pre  # placeholders without a shared expert
        sw2 = sw2 if sw2 is not None else self.hs_a
        mp = rt._map
        maps = [mp(x, n, D, 128), mp(sw1, sw1.shape[0], sw1.shape[1], 128),
                mp(dy, n, D, 128), mp(sw2, sw2.shape[0], sw2.shape[1], 64),
                mp(self.hs_dh, n, 2 * IS, 128), mp(sw1, sw1.shape[0], sw1.shape[1], 64),
                mp(dy, n, D, 64), mp(self.hs_a, n, IS, 64), mp(self.hs_dh, n, 2 * IS, 64),
                mp(x, n, D, 64),
                mp(b.ring_x, M, D, 128), mp(w1, L * 2 * I, D, 128),
                mp(self.ring_dy, M, D, 128), mp(w2, L * D, I, 64),
                mp(self.ring_dh, M, 2 * I, 128), mp(w1, L * 2 * I, D, 64),
                mp(self.ring_do, M, D, 64), mp(b.ring_a, M, I, 64),
                mp(self.ring_dh, M, 2 * I, 64), mp(b.ring_x, M, D, 64)]
        maps_raw = b"".join(cuda.tensor_map_bytes(m) for m in maps)
        f8, fp8_ptrs = self._fp8_operands(b, w1, w2)
        peers = struct.pack(f"<{s.ep}Q", *x_ptrs) + struct.pack(f"<{s.ep}Q", *dy_ptrs) \
            + rt.peers.table("combine") + rt.peers.table("dweight")
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        bufs = struct.pack(
            "<32Q4i", b.table.data_ptr(), b.row_weight.data_ptr(), b.meta.data_ptr(),
            b.offsets.data_ptr(), self.segs.data_ptr(), self.seg_start.data_ptr(),
            b.ring_x.data_ptr(), b.ring_h.data_ptr(), b.ring_a.data_ptr(),
            self.ring_dy.data_ptr(), self.ring_do.data_ptr(), self.ring_dh.data_ptr(),
            self.dw_part.data_ptr(), self.hs_pre.data_ptr(), self.hs_a.data_ptr(),
            self.hs_dh.data_ptr(), b.y_shared.data_ptr(), dw1.data_ptr(), dw2.data_ptr(),
            ptr(dsw1), ptr(dsw2), self.wg_acc.data_ptr(),
            self.counters.data_ptr(), *fp8_ptrs, n, s.max_minibatches, rt.peers.hosted_ranks[i],
            int(resident))
        cuda.launch(self.f_bwd, rt.num_sms, 384, self.smem, st,
                    [cuda.Raw(maps_raw), f8, cuda.Raw(peers), cuda.Raw(bufs)], cooperative=True)

    def _fp8_operands(self, b, w1, w2):
        """The fp8 backward's Fp8BwdMaps (by value) and BwdBuffers fields (ring_x8, ring_sx,
        ring_dy8, ring_sdy, ring_dh8, ring_sdh, w1s, w2ts, w1ts); zeros for bf16 plans."""
        rt, s, q = self.rt, self.rt.spec, self.rt.spec.scale_block
        if not q:
            return cuda.Raw(bytes(12 * cuda.TENSOR_MAP_BYTES)), (0,) * 9
        L, D, I, M = s.local_experts, s.hidden, s.intermediate, s.macrobatch
        w, wt = rt.weights.get(w1, w2), rt.weights.transposed(w1, w2)
        maps = rt.fp8_maps([(b.ring_x8, M, D), (w.w1, L * 2 * I, D), (self.ring_dy8, M, D),
                            (wt.w2, L * I, D), (self.ring_dh8, M, 2 * I), (wt.w1, L * D, 2 * I)],
                           [(b.ring_sx, D, M), (self.ring_sdy, D, M), (self.ring_sdh, 2 * I, M)],
                           [(w.s1, D, L * 2 * I), (wt.s2, D, L * I), (wt.s1, 2 * I, L * D)])
        blockwise = (w.s1.data_ptr(), wt.s2.data_ptr(), wt.s1.data_ptr()) if q == 128 \
            else (0, 0, 0)
        ptrs = (b.ring_x8.data_ptr(), b.ring_sx.data_ptr(), self.ring_dy8.data_ptr(),
                self.ring_sdy.data_ptr(), self.ring_dh8.data_ptr(), self.ring_sdh.data_ptr(),
                *blockwise)
        return maps, ptrs


def _sum(ts):
    """bf16 tensors summed in fp32, in list order (one tensor: itself)."""
    return ts[0] if len(ts) == 1 else torch.stack(ts).float().sum(0).to(BF16)
