"""The backward layer at run time: launches the backward megakernel on the forward runtime's
buffers (its rings, schedule and peer tables), on the current torch stream, no host sync.

Ring-aware replay: when the rings still hold the forward being differentiated (nothing ran
on this layer in between, and that forward kept its gate/up pre-activations), the kernel
takes macrobatch 0 from the ring and the shared expert's activations from where the forward
left them, and replays only the rest; otherwise it re-schedules from the saved routes,
replays everything and recomputes the shared expert's gate/up. Either way the gradients are
the same. keep_h plans replay nothing: each call's forward left its h (and the shared
expert's activations) in buffers of its own (workspace.py KeptActivations), which the
backward is handed; it re-schedules where the tables were rewritten and pulls x.

Virtual ranks run their backward megakernels one after another, except where the plan leaves
room for all of them at once (reserve_sms): then side by side, each rank with its own scratch.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import torch

from mokgen.runtime import abi, cuda
from mokgen.runtime.abi import padded
from mokgen.runtime.checks import check_ctas
from mokgen.runtime.workspace import BF16, BackwardScratch, activation_buffers, backward_ring_dy, backward_tiles


class _Kernel(NamedTuple):
    """A loaded backward kernel and what its module's globals say of its launch."""
    module: object
    function: object
    smem: int
    ctas: int
    wgrad_tma: bool


def _resident(spec, ring_holds_call: bool, kept) -> int:
    """The kernel's resident (moe_bwd.cuh BwdBuffers) for a call whose forward the ring still
    holds (or not), with its kept activations (keep_h) or None: 2 where a keep_h backward's
    ring also holds this call's x (nothing ran since a forward that copied x), so it pulls
    only dy; 1 where h is the call's (the ring, or kept); 0 where it replays."""
    if ring_holds_call:
        return 2 if spec.keep_h and spec.dispatch != "gather" else 1
    return int(kept is not None)


class BackwardPass:
    """The backward kernel over its scratch (BackwardScratch, a part of the forward's
    workspace) and the forward's runtime."""

    def __init__(self, rt, bwd_cubin: bytes, resident_cubin: bytes | None = None):
        """`resident_cubin`: keep_h plans' second kernel (codegen "bwdres",
        plan.resident_twin), launched where the ring still holds the call's own forward."""
        self.rt, self.poisoned = rt, False
        self.kernel = self._load(bwd_cubin)
        self.resident_kernel = self._load(resident_cubin) if resident_cubin else None
        # the modules whose mokgen_trace global a trace sets (trace.cuh): a keep_h call
        # whose ring holds its forward runs resident_kernel's
        self.modules = tuple(k.module for k in (self.kernel, self.resident_kernel) if k)
        # whether the kernel stores whole-expert weight-gradient tiles with TMA (moe_bwd.cuh
        # kTmaWgrad): then each call passes maps of its dw1 / dw2 and turns it on
        self.wgrad_tma = self.kernel.wgrad_tma
        if self.resident_kernel and self.resident_kernel.wgrad_tma != self.wgrad_tma:
            raise RuntimeError("mokgen: the two backward kernels store weight gradients "
                               "differently")
        self.ctas = max(k.ctas for k in (self.kernel, self.resident_kernel) if k)
        s, virtual = rt.spec, rt.virtual  # (rt.peers would take a released workspace back)
        # side by side where the plan leaves room, as real ranks run: each hosted rank needs
        # scratch of its own
        self.side_by_side = virtual and s.ep > 1 and s.ep * self.ctas <= rt.num_sms

    @property
    def scratch(self) -> list:
        """Per hosted rank the BackwardScratch its kernel runs on: one shared where the ranks
        run one after another. Kept in the forward's workspace (its dy ring may be the combine
        rows), so released and made again with it."""
        return self.rt.held_part("backward", self._make_scratch)

    def _make_scratch(self) -> list:
        rt, s = self.rt, self.rt.spec
        hosted = range(rt.hosted)
        made = [BackwardScratch(s, rt.dev, backward_ring_dy(s, rt.peers.local(i)))
                for i in (hosted if self.side_by_side else hosted[:1])]
        scratch = made if self.side_by_side else made * len(hosted)
        if self.poisoned:
            self._fill_poison(made)
        return scratch

    def _load(self, cubin: bytes) -> "_Kernel":
        """A backward kernel's module, checked against the workspace it will run on."""
        rt = self.rt
        mod = cuda.load_module(cubin)
        rt.adopt_module(mod)
        glob = lambda name, fmt="<i": struct.unpack(  # noqa: E731
            fmt, cuda.read_global(mod, name))
        smem = glob("mokgen_bwd_smem_bytes")[0]
        # the kernel's tile counts (bwd.cu.j2): dgrad tiles across I, weight-gradient tiles
        # per expert, which BackwardScratch sized dw_part and the counters by
        tiles = glob("mokgen_bwd_tiles", "<2i")
        if tiles != backward_tiles(rt.spec):
            raise RuntimeError(f"mokgen: the backward kernel's tile counts {tiles} differ "
                               f"from the workspace's {backward_tiles(rt.spec)}")
        # and its x ring's rows (a window: passes/x_window.py), which RankBuffers sized
        x_rows = glob("mokgen_bwd_x_rows")[0]
        if x_rows != rt.spec.x_rows:
            raise RuntimeError(f"mokgen: the backward kernel's x ring has {x_rows} rows, the "
                               f"workspace's {rt.spec.x_rows}")
        return _Kernel(mod, mod.function("mokgen_bwd", smem), smem,
                       # the plan's CTAs (after its reserve)
                       check_ctas("backward", glob("mokgen_bwd_ctas")[0], rt.num_sms),
                       bool(glob("mokgen_bwd_wgrad_tma")[0]))

    def poison(self) -> None:
        """As ForwardRuntime.poison, for the backward's scratch and the router-weight
        gradients (a scratch allocated again is filled alike)."""
        self.poisoned = True
        self._fill_poison(dict.fromkeys(self.scratch))  # each scratch once

    def _fill_poison(self, scratch) -> None:
        for sc in scratch:
            for t in (sc.ring_dy, sc.dw_part, sc.wg_acc):
                if t is not None:
                    t.fill_(float("nan"))
            if self.rt.spec.scale_block:
                sc.ring_dy8.fill_(0xFF)  # e4m3 NaN
                sc.ring_dh8.fill_(0xFF)
                sc.ring_sdy.fill_(float("nan"))
                sc.ring_sdh.fill_(float("nan"))
        for b in self.rt.ranks:
            b.dweight.fill_(float("nan"))

    # ------------------------------------------------------------------ the call
    def backward(self, dys, xs, w1s, w2s, shared_w1, shared_w2, routes, generation,
                 accumulate=None, kept=None):
        """Per hosted rank lists. `routes`: per hosted rank (experts int32 [n, k] global ids,
        weights fp32 [n, k]) of the forward being differentiated; `generation`: that
        forward's `rt.generation`. Returns (dxs, dweights [n, k] fp32, dw1s, dw2s, dsw1,
        dsw2); the shared gradients are summed over the hosted ranks (None without one).
        `accumulate`: per hosted rank (dw1, dw2) bf16 tensors shaped like w1 and w2 that
        the kernel adds the expert weight gradients into (fused gradient accumulation); they
        are then the dw1s and dw2s returned. `kept`: per hosted rank the forward's own
        KeptActivations (keep_h plans: required): its h is then resident whatever ran since,
        and only the schedule is rebuilt where the tables were rewritten."""
        rt, s = self.rt, self.rt.spec
        n = xs[0].shape[0]
        hosted = range(rt.hosted)
        if s.keep_h and kept is None:
            raise ValueError("mokgen: a keep_h layer's backward needs its forward's kept "
                             "activations (CompiledMoE.forward_raw returns them)")
        tables = rt.saved and generation == rt.generation  # the schedule is that forward's
        resident = _resident(s, tables, kept)
        rt.generation += 1  # the backward's pulls overwrite the rings
        rt.saved = False
        rt.stats["backward"] += 1
        rt.stats["replayed"] += not resident
        rt.stats["resident_kernel"] += resident == 2 and self.resident_kernel is not None
        # staged x and dy, and every rank done reading its combine rows (the dx rows reuse
        # them), before any rank's kernel touches a peer
        x_ptrs = rt.peers.x_pointers(xs)
        dy_ptrs = rt.peers.x_pointers(dys, "dy")
        if not tables:  # the tables were rewritten since: rebuild them from the routes
            for i in hosted:
                rt.route_given(i, *routes[i], n)
        rt.peers.barrier(rt._launch_barrier)
        if not tables:  # (the same layout as the forward's: Algorithm 1 is deterministic)
            for i in hosted:
                rt.schedule(i, n)
        if accumulate is not None:
            _check_accumulate(accumulate, w1s, w2s)
            dw1s, dw2s = [a[0] for a in accumulate], [a[1] for a in accumulate]
        else:
            dw1s = [rt.output(tuple(w.shape), BF16) for w in w1s]
            dw2s = [rt.output(tuple(w.shape), BF16) for w in w2s]
        dsw = [[rt.output(tuple(w.shape), BF16) for w in (shared_w1, shared_w2)]
               if shared_w1 is not None else [None, None] for _ in hosted]
        launch = lambda i: self._launch(  # noqa: E731
            i, n, xs[i], dys[i], x_ptrs, dy_ptrs, w1s[i], w2s[i], shared_w1, shared_w2,
            dw1s[i], dw2s[i], *dsw[i], resident, accumulate is not None, kept and kept[i])
        if self.side_by_side:
            _ = self.scratch  # made (and poisoned) on this stream, before the ranks' streams fork
            rt.side_by_side(list(hosted), launch)
        else:
            for i in hosted:
                launch(i)
        rt.peers.barrier(rt._launch_barrier)
        dxs = [self.dx_of(i, n) for i in hosted]
        dweights = [rt.ranks[i].dweight[: n * s.topk].view(n, s.topk).clone() for i in hosted]
        # the shared expert's gradients: every hosted rank's tokens, summed in rank order
        dsw1, dsw2 = (None if shared_w1 is None else _sum([d[j] for d in dsw]) for j in (0, 1))
        return dxs, dweights, dw1s, dw2s, dsw1, dsw2

    def backward_rank(self, i, dys, xs, w1s, w2s, shared_w1, shared_w2, accumulate=None):
        """Hosted rank i's own backward alone (segments, megakernel, its dx sum) right after
        its forward_rank(save=True), reusing the other ranks' buffers from an earlier full
        call: the per-rank slice that benchmarks time. `accumulate`: rank i's (dw1, dw2) to
        add the expert weight gradients into, as backward's. -> (dx, dw1, dw2, dsw1, dsw2)."""
        rt, n = self.rt, xs[0].shape[0]
        # keep_h plans: the forward_rank's own kept h, with x still in the ring (resident 2)
        kept = rt.slice_kept if rt.spec.keep_h else None
        if rt.spec.keep_h and (not rt.saved or kept is None):
            raise ValueError("keep_h: a per-rank backward reads the kept h of the forward_rank"
                             " (save=True) right before it")
        resident = _resident(rt.spec, rt.saved, kept)
        rt.generation += 1
        rt.saved = False
        if accumulate is not None:
            _check_accumulate([accumulate], [w1s[i]], [w2s[i]])
            dw1, dw2 = accumulate
        else:
            dw1, dw2 = torch.empty_like(w1s[i]), torch.empty_like(w2s[i])
        dsw1 = None if shared_w1 is None else torch.empty_like(shared_w1)
        dsw2 = None if shared_w2 is None else torch.empty_like(shared_w2)
        self._launch(i, n, xs[i], dys[i], rt.peers.x_pointers(xs),
                     rt.peers.x_pointers(dys, "dy"), w1s[i], w2s[i], shared_w1, shared_w2, dw1,
                     dw2, dsw1, dsw2, resident, accumulate is not None, kept=kept)
        return self.dx_of(i, n), dw1, dw2, dsw1, dsw2

    def dx_of(self, i, n):
        """Hosted rank i's dx after its kernel: the shared expert's plus the routed rows,
        summed in route order from the combine rows, or (dx rows in the dy ring) from the
        ring rows the schedule table puts each route at."""
        rt, s, b = self.rt, self.rt.spec, self.rt.ranks[i]
        if not s.dx_ring:
            return rt.combine_sum(i, n)
        sc = self.scratch[i]
        cuda.launch(rt.f_table_pos, max(1, min(1024, -(-s.max_rows // 256))), 256, 0,
                    rt._stream(), [b.table, b.meta, sc.pos])
        return rt.combine_sum(i, n, at=(sc.ring_dy, sc.pos))

    def _launch(self, i, n, x, dy, x_ptrs, dy_ptrs, w1, w2, sw1, sw2, dw1, dw2, dsw1, dsw2,
                resident, accumulate=False, kept=None):
        rt, s, b, sc = self.rt, self.rt.spec, self.rt.ranks[i], self.scratch[i]
        st = rt._stream()
        rt.prologue.segments(st, b, s.ep, sc.segs, sc.seg_start)
        sc.counters.zero_()
        L, D, I, M = s.local_experts, s.hidden, s.intermediate, s.macrobatch
        # the shared expert's activations: the forward's where resident, else recomputed
        # there (moe_bwd.cuh); dh lands over hs_pre. keep_h: h and those are the call's own
        ring_h, hs_pre, hs_a = activation_buffers(b, kept)
        IS = hs_a.shape[1]
        sw1 = sw1 if sw1 is not None else hs_pre  # placeholders without a shared expert
        sw2 = sw2 if sw2 is not None else hs_a
        mp = rt._map_bytes
        maps = {"x_k": mp(x, n, D, 128), "sw1_k": mp(sw1, sw1.shape[0], sw1.shape[1], 128),
                "dy_k": mp(dy, n, D, 128), "sw2_mn": mp(sw2, sw2.shape[0], sw2.shape[1], 64),
                "hs_dh_k": mp(hs_pre, n, 2 * IS, 128),  # dh over the pre-activations
                "sw1_mn": mp(sw1, sw1.shape[0], sw1.shape[1], 64), "dy_mn": mp(dy, n, D, 64),
                "hs_a_mn": mp(hs_a, n, IS, 64), "hs_dh_mn": mp(hs_pre, n, 2 * IS, 64),
                "x_mn": mp(x, n, D, 64),
                "w1_k": mp(w1, L * 2 * I, D, 128), "w2_mn": mp(w2, L * D, I, 64),
                # dh lands over the pre-activations, w * a over a (moe_bwd.cuh, DG)
                # (a call's kept h has its own rows: KeptActivations.kept_rows)
                "ring_dh_k": mp(ring_h, ring_h.shape[0], 2 * I, 128),
                "w1_mn": mp(w1, L * 2 * I, D, 64), "ring_a_mn": mp(b.ring_a, M, I, 64),
                "ring_dh_mn": mp(ring_h, ring_h.shape[0], 2 * I, 64)}
        # gathered rows (no x or dy ring): x's and dy's own maps in their places, unread
        for ring, t, src in (("ring_x", b.ring_x, "x"), ("ring_dy", sc.ring_dy, "dy")):
            maps[f"{ring}_k"] = maps[f"{src}_k"] if t is None else mp(t, t.shape[0], D, 128)
            maps[f"{ring}_mn"] = maps[f"{src}_mn"] if t is None else mp(t, t.shape[0], D, 64)
        # the weight gradients for the TMA stores of whole-expert tiles (fused accumulation:
        # TMA reductions into the caller's .grad), whose base TMA can address (16-byte
        # aligned); otherwise zero maps, unused
        tma = self.wgrad_tma and all(
            t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (dw1, dw2))
        # 3D maps (an expert a matrix): an edge row tile stops at its expert's last row
        maps["dw1_st"] = rt._map3d_bytes(dw1.view(L, 2 * I, D), 64, 64) if tma else None
        maps["dw2_st"] = rt._map3d_bytes(dw2.view(L, D, I), 64, 64) if tma else None
        maps_raw = abi.pack_maps(abi.BWD_MAPS, maps, lambda m: bytes(abi.TENSOR_MAP_BYTES)
                                 if m is None else m)
        # keep_h: a call whose ring holds its own forward runs the resident twin's kernel
        # (the default plan's), to which resident 1 says the same (it has no x pull to skip)
        k = self.resident_kernel if resident == 2 and self.resident_kernel else self.kernel
        if k is self.resident_kernel:
            resident = 1
        f8, fp8_fields = self._fp8_operands(b, sc, w1, w2)
        peers = struct.pack(f"<{s.ep}Q", *x_ptrs) + struct.pack(f"<{s.ep}Q", *dy_ptrs) \
            + rt.peers.table("combine") + rt.peers.table("dweight")
        bufs = abi.pack(
            abi.BWD_BUFFERS, table=b.table, row_weight=b.row_weight, meta=b.meta,
            offsets=b.offsets, segs=sc.segs, seg_start=sc.seg_start, ring_x=b.ring_x,
            ring_h=ring_h, ring_a=b.ring_a, ring_dy=sc.ring_dy, dw_part=sc.dw_part,
            hs_pre=hs_pre, hs_a=hs_a, dx_shared=b.y_shared, dw1=dw1, dw2=dw2,
            dsw1=dsw1, dsw2=dsw2, wg_acc=sc.wg_acc, counters=sc.counters, **fp8_fields, n_tokens=n,
            max_minibatches=s.max_minibatches, rank=rt.peers.hosted_ranks[i],
            resident=int(resident), accumulate=int(accumulate),
            wg_by_minibatch=int(s.wg_by_minibatch), wgrad_tma=int(tma))
        cuda.launch(k.function, k.ctas, 384, k.smem, st,
                    [cuda.Raw(maps_raw), f8, cuda.Raw(peers), cuda.Raw(bufs)],
                    cooperative=True)
        if s.scale_block:
            rt.weights.backward_done(w1, w2)

    def _fp8_operands(self, b, sc, w1, w2):
        """The fp8 backward's Fp8BwdMaps (by value) and its BwdBuffers fields; zero maps and
        null pointers for bf16 plans."""
        rt, s, q = self.rt, self.rt.spec, self.rt.spec.scale_block
        fields = ("ring_x8", "ring_sx", "ring_dy8", "ring_sdy", "ring_dh8", "ring_sdh", "w1s",
                  "w2ts", "w1ts")
        if not q:
            return (cuda.Raw(bytes(len(abi.FP8_BWD_MAPS) * abi.TENSOR_MAP_BYTES)),
                    dict.fromkeys(fields, 0))
        L, D, I, M = s.local_experts, s.hidden, s.intermediate, s.macrobatch
        PD, PI = padded(D), padded(I)  # the weights' (and dh's) padded widths (pad_weight)
        w, wt = rt.weights.get(w1, w2), rt.weights.transposed(w1, w2)
        maps = rt.fp8_maps(abi.FP8_BWD_MAPS,
                           {"ring_x": (b.ring_x8, M, D), "w1": (w.w1, L * 2 * PI, PD),
                            "ring_dy": (sc.ring_dy8, M, D), "w2t": (wt.w2, L * PI, PD),
                            "ring_dh": (sc.ring_dh8, M, 2 * PI),
                            "w1t": (wt.w1, L * PD, 2 * PI)},
                           {"ring_sx": (b.ring_sx, D, M), "ring_sdy": (sc.ring_sdy, D, M),
                            "ring_sdh": (sc.ring_sdh, 2 * PI, M)},
                           {"w1s": (w.s1, PD, L * 2 * PI), "w2ts": (wt.s2, PD, L * PI),
                            "w1ts": (wt.s1, 2 * PI, L * PD)})
        blockwise = q == 128
        return maps, dict(ring_x8=b.ring_x8, ring_sx=b.ring_sx, ring_dy8=sc.ring_dy8,
                          ring_sdy=sc.ring_sdy, ring_dh8=sc.ring_dh8,
                          ring_sdh=sc.ring_sdh, w1s=w.s1 if blockwise else None,
                          w2ts=wt.s2 if blockwise else None, w1ts=wt.s1 if blockwise else None)


def _check_accumulate(acc, w1s, w2s) -> None:
    for (g1, g2), w1, w2 in zip(acc, w1s, w2s, strict=True):
        for g, w in ((g1, w1), (g2, w2)):
            if not (g.dtype == BF16 and g.shape == w.shape and g.is_contiguous()
                    and g.device == w.device):
                raise ValueError("mokgen: fused gradient accumulation needs contiguous bf16 "
                                 f"gradients shaped like the weights, got {g.dtype} "
                                 f"{tuple(g.shape)} for {tuple(w.shape)}")


def _sum(ts):
    """bf16 tensors summed in fp32, in list order (one tensor: itself)."""
    return ts[0] if len(ts) == 1 else torch.stack(ts).float().sum(0).to(BF16)
