"""The forward layer at run time: owns the device buffers, launches the generated kernels on
the current torch stream, never synchronizes with the host.

Knows nothing of plans or passes: it gets a `LayerSpec` (plain sizes) and the verified cubins
(bytes; build.py checked their hashes).
Ranks: `virtual=True` hosts all R ranks on this GPU (their kernels run one after another on
the stream; the paper's directions leave the forward megakernel no cross-rank waits, so this
is the whole EP protocol on one GPU; a plan that leaves room for all R megakernels at once
runs them side by side); otherwise this process is one rank and peers come from symmetric
memory.
"""
from __future__ import annotations

import struct
import weakref
from collections import OrderedDict

import torch

from mokgen.runtime import abi, cuda
from mokgen.runtime.abi import padded
from mokgen.runtime.checks import check_ctas
from mokgen.runtime.peers import PeerSet
from mokgen.runtime.prologue import Prologue, warp_per_token_grid
from mokgen.runtime.weight_quant import WeightCache
from mokgen.runtime.workspace import (KeptActivations, LayerSpec, RankBuffers,  # noqa: F401 - LayerSpec:
                        activation_buffers, nbytes, tensors_of)  # LayerSpec re-exported

BF16 = torch.bfloat16
MAX_MAPS = 4096  # tensor maps kept (128 B each): a 48-layer model uses about 30 per layer


class ForwardRuntime:
    def __init__(self, spec: LayerSpec, prologue_cubin: bytes, fwd_cubin: bytes, virtual: bool,
                 group=None, watchdog_s: float = 5.0, device: torch.device | None = None):
        self.spec = spec
        self.virtual = virtual
        # the current CUDA device; another only where tests run the host side alone (CPU)
        self.dev = device or torch.device("cuda", torch.cuda.current_device())
        pro = cuda.load_module(prologue_cubin)
        fwd = cuda.load_module(fwd_cubin)
        self.fwd_module = fwd  # its globals: a trace sets mokgen_trace (trace.cuh)
        self.prologue = Prologue(pro, spec.local_experts, spec.topk)
        self.f_sum = pro.function("mokgen_combine_sum")
        # the backward's dx sum where its rows stay in the dy ring (reverse_dispatch "ring")
        self.f_table_pos = pro.function("mokgen_table_positions")
        self.f_sum_at = pro.function("mokgen_combine_sum_at")
        self.f_quant_x = pro.function("mokgen_quant_x") if spec.scale_block else None
        self.fwd_smem = struct.unpack("<i", cuda.read_global(fwd, "mokgen_fwd_smem_bytes"))[0]
        self.f_fwd = fwd.function("mokgen_fwd", self.fwd_smem)
        self.num_sms = torch.cuda.get_device_properties(self.dev).multi_processor_count
        # the plan's CTA count (SMs less its reserve for collectives), compiled into the cubin
        self.fwd_ctas = check_ctas("forward", struct.unpack(
            "<i", cuda.read_global(fwd, "mokgen_fwd_ctas"))[0], self.num_sms)
        # multicast pairs (GemmConfig.pair): the launch in 2-CTA clusters, every one resident
        self.fwd_cluster = struct.unpack("<i", cuda.read_global(fwd, "mokgen_fwd_cluster"))[0]
        if self.fwd_cluster > 1:
            fit = self.fwd_cluster * cuda.max_active_clusters(self.f_fwd, 384, self.fwd_smem,
                                                              self.fwd_cluster)
            if fit < self.fwd_ctas:
                raise ValueError(f"mokgen: the forward kernel runs {self.fwd_ctas} CTAs in "
                                 f"clusters of {self.fwd_cluster}, this GPU holds {fit} at "
                                 f"once: plan it with gemm_fwd.pair False")
        self.modules = []
        self.watch = cuda.HostMapped(4 * abi.WATCH_WORDS)
        self.watchdog_s = watchdog_s
        for m in (pro, fwd):
            self.adopt_module(m)
        # Virtual ranks whose plan leaves room for all R megakernels at once (reserve_sms)
        # run them side by side, as real ranks would.
        self.side_by_side_ranks = virtual and spec.ep > 1 and \
            spec.ep * self.fwd_ctas <= self.num_sms
        self._side_streams = None
        self.group, self.poison_outputs = group, False
        self._workspace = None  # the buffers while held: _held(), release()
        self.call_bytes = 0  # the most bytes the workspace held at a release
        # real ranks rendezvous their symmetric memory here, together
        self.hosted = len(self._held()["ranks"])  # ranks this process hosts
        self.f_barrier = pro.function("mokgen_barrier")
        self._maps: OrderedDict = OrderedDict()
        # Which forward the rings hold: bumped by every call of any layer sharing this
        # runtime; `saved` when that call kept the gate/up pre-activations for a backward (the
        # ring's macrobatch 0 is then reusable by that call's backward, and by no other).
        self.generation, self.saved = 0, False
        self.slice_kept = None  # keep_h plans: the last forward_rank(save=True)'s kept h
        self.layers = weakref.WeakSet()  # the layers using this runtime (memory reports)
        # replayed: backward calls not resident; resident_kernel: keep_h backward calls that
        # ran the resident twin's kernel (moe_bwd.py BackwardPass)
        self.stats = {"backward": 0, "replayed": 0, "resident_kernel": 0}
        # The calling layer's fp8 weight cache: each layer owns one (CompiledMoE sets it
        # before a call), so layers sharing this runtime do not evict each other's weights.
        self.weights = WeightCache(spec.scale_block, self.hosted, pro)

    def adopt_module(self, m) -> None:
        """Point a loaded module's watchdog globals (each module has its own copy) at this
        layer's record, so check() sees and re-arms it too."""
        cuda.set_global(m, "mokgen_watch", struct.pack("<Q", self.watch.device))
        cuda.set_global(m, "mokgen_watch_timeout_ns",
                        struct.pack("<Q", int(self.watchdog_s * 1e9)))
        self.modules.append(m)

    # ------------------------------------------------------------------ the workspace
    @property
    def peers(self) -> PeerSet:
        return self._held()["peers"]

    @property
    def ranks(self) -> list:
        """Per hosted rank its RankBuffers."""
        return self._held()["ranks"]

    def _held(self) -> dict:
        """The workspace (peer buffers, the ranks' buffers, and parts other passes keep in it:
        held_part), allocated again where release() returned it."""
        if self._workspace is None:
            peers = PeerSet(self.spec, self.dev, self.virtual, self.group)
            self._workspace = {"peers": peers, "ranks": [
                RankBuffers(self.spec, self.dev, peers.local(i))
                for i in range(len(peers.hosted_ranks))],
                "stream": torch.cuda.current_stream(self.dev) if self.dev.type == "cuda"
                else None}
            if self.poison_outputs:
                self._fill_poison()
        return self._workspace

    def held_part(self, name: str, make):
        """A part of the workspace another pass owns (the backward's scratch, which may view
        the combine rows): made on first use, released with the rest."""
        ws = self._held()
        if name not in ws:
            ws[name] = make()
        return ws[name]

    def release(self) -> None:
        """Return the workspace to PyTorch's caching allocator until the next call, which
        takes it back (from the allocator's cache: the same blocks, unless another tensor took
        them meanwhile). So between calls, where a training step peaks (FSDP2's gradient
        reduction, the optimizer), mokgen holds nothing. What the rings held is gone: a
        backward after it rebuilds its schedule and replays what it needs. Real ranks keep
        their symmetric memory (allocated together, once)."""
        if self._workspace is not None and self._workspace["peers"].virtual:
            ws, self._workspace = self._workspace, None
            held = self._tensors(ws)
            self.call_bytes = max(self.call_bytes, nbytes(held))
            if self.dev.type == "cuda":
                # The allocator reuses a block on the stream that allocated it; a call on
                # another stream since (a backward on autograd's) may still be reading it
                stream = torch.cuda.current_stream(self.dev)
                if stream != ws["stream"]:
                    for t in held:
                        t.record_stream(stream)
            self.generation += 1
            self.saved = False

    def held_bytes(self) -> int:
        """Bytes of the workspace held now (0 between calls once released)."""
        ws = self._workspace
        return 0 if ws is None else nbytes(self._tensors(ws))

    @staticmethod
    def _tensors(ws: dict) -> list:
        return tensors_of(*ws["ranks"], *ws["peers"].bufs.values(), *ws.get("backward", []))

    def poison(self) -> None:
        """Fill every buffer a call must write with NaN (and the schedule with -2, which
        reads as padding), and make calls return NaN-filled outputs until written: a test
        then sees any element the kernels skip. A workspace allocated again (release) is
        filled alike."""
        self.poison_outputs = True
        self._fill_poison()

    def _fill_poison(self) -> None:
        for b in self.ranks:
            for t in (b.combine, b.ring_x, b.ring_a, b.ring_h, b.h_shared, b.hs_pre,
                      b.y_shared, b.row_weight):
                if t is not None:
                    t.fill_(float("nan"))
            b.table.fill_(-2)
            if self.spec.scale_block:
                for t in (b.ring_x8, b.ring_a8):
                    t.fill_(0xFF)  # e4m3 NaN
                for t in (b.ring_sx, b.ring_sa):
                    t.fill_(float("nan"))

    # ------------------------------------------------------------------ helpers
    def _map(self, t: torch.Tensor, rows: int, cols: int, box_rows: int, box_cols: int = 64,
             dtype: str = "bf16", swizzle: int = 128):
        """TMA map of a row-major [rows, cols] matrix of t's elements, box box_cols x
        box_rows (bf16 operands: 64 columns x 128 or 256 rows for K-major tiles, 64 for MN-major
        ones). Cached by address, geometry and swizzle."""
        return self._map_entry(t, rows, cols, box_rows, box_cols, dtype, swizzle)[0]

    def _map_bytes(self, t: torch.Tensor, rows: int, cols: int, box_rows: int,
                   box_cols: int = 64) -> bytes:
        """_map's 128 bytes, for a map struct passed by value (read once per map, not once
        per call: the backward packs ~20 a call)."""
        return self._map_entry(t, rows, cols, box_rows, box_cols, "bf16", 128)[1]

    def _map_entry(self, t, rows, cols, box_rows, box_cols, dtype, swizzle) -> tuple:
        return self._cached((t.data_ptr(), rows, cols, box_rows, box_cols, dtype, swizzle),
                            lambda: cuda.make_tensor_map_2d(
                                t, rows, cols, cols * t.element_size(), box_rows, box_cols,
                                dtype=dtype, swizzle=swizzle))

    def _map3d_bytes(self, t: torch.Tensor, box_rows: int, box_cols: int) -> bytes:
        """The bytes of cuda.make_tensor_map_3d(t, ...) over a contiguous [depth, rows, cols]
        bf16 tensor, cached by address and geometry as the 2D maps."""
        return self._cached((t.data_ptr(), *t.shape, box_rows, box_cols, "3d"),
                            lambda: cuda.make_tensor_map_3d(t, box_rows, box_cols))[1]

    def _cached(self, key, make) -> tuple:
        """(map, its bytes) under key, made on a miss; least recently used out past
        MAX_MAPS (many layers' weights and ever new activations)."""
        if key in self._maps:
            self._maps.move_to_end(key)
        else:
            m = make()
            self._maps[key] = (m, cuda.tensor_map_bytes(m))
            if len(self._maps) > MAX_MAPS:
                self._maps.popitem(last=False)
        return self._maps[key]

    def check(self) -> None:
        """Raise the watchdog's record of an earlier call as a RuntimeError. Reads host-mapped
        memory only: no device synchronization (a call's record is there once it finished)."""
        w = self.watch.words(abi.WATCH_WORDS)
        if w[0] != abi.WATCH_MAGIC:
            return
        phase = abi.phase_text(w[2]).format(index=w[3])
        self.watch.clear()
        for m in self.modules:  # re-arm, so the layer can be called again after the error
            cuda.set_global(m, "mokgen_abort", struct.pack("<I", 0))
        raise RuntimeError(
            f"mokgen watchdog: rank {w[1]} (CTA {w[6]}) waited longer than the timeout in "
            f"{phase}: flag value {w[4]}, expected >= {w[5]}. The call was abandoned and its "
            f"outputs are invalid; a peer or an earlier kernel never signalled.")

    def device_check(self) -> list:
        """Debug builds: the first failed device-side index check of each module
        ({code, a, b, block, failures}; a and b signed), all zero when none failed.
        Synchronizes."""
        return [list(struct.unpack("<IiiII", cuda.read_global(m, "mokgen_check")))
                for m in self.modules]

    def _launch_barrier(self, epoch: int, hosted: int = 0) -> None:
        cuda.launch(self.f_barrier, 1, 32, 0, self._stream(),
                    [cuda.Raw(self.peers.table("flags")), self.peers.local(hosted)["flags"],
                     self.peers.hosted_ranks[hosted], self.spec.ep, epoch])

    def _stream(self):
        return torch.cuda.current_stream(self.dev)

    # ------------------------------------------------------------------ the call
    def forward(self, xs, logits, w1s, w2s, shared_w1, shared_w2, routes=None, save=False,
                kept=None):
        """Per hosted rank lists; returns the list of y [n, D] bf16. `routes`: per hosted rank
        (experts int32 [n, k], weights fp32 [n, k]) chosen by the caller, instead of logits.
        `save`: keep the gate/up pre-activations (and, fp8 plans, the SwiGLU output in bf16)
        in the ring for a backward, which then replays only what the ring lost; `kept` (keep_h
        plans, with save): per hosted rank the call's own KeptActivations (new_kept) to
        keep them in instead."""
        n = xs[0].shape[0]
        if self.spec.keep_h and save and kept is None:
            raise ValueError("mokgen: a keep_h layer's forward with save keeps its h in the "
                             "call's own buffers: pass kept=rt.new_kept(n)")
        self.generation += 1
        self.saved = save
        hosted = range(self.hosted)
        x_ptrs = self.peer_rows(xs)  # staged before the barrier: peers read it after
        for i in hosted:
            self.ranks[i].counters.zero_()
            self.quantize_x(i, xs[i])
            if routes is None:
                self.route(i, logits[i], n)
            else:
                self.route_given(i, *routes[i], n)
        self.peers.barrier(self._launch_barrier)
        if self.side_by_side_ranks:
            for i in hosted:
                self.schedule(i, n)
            self.side_by_side(hosted, lambda i: self.experts(
                i, xs[i], x_ptrs, w1s[i], w2s[i], shared_w1, shared_w2, save,
                kept and kept[i]))
        else:
            for i in hosted:
                self.schedule(i, n)
                self.experts(i, xs[i], x_ptrs, w1s[i], w2s[i], shared_w1, shared_w2, save,
                             kept and kept[i])
        self.peers.barrier(self._launch_barrier)
        return [self.combine_sum(i, n) for i in hosted]

    def new_kept(self, n) -> list:
        """Per hosted rank a call's own KeptActivations (keep_h plans; NaN under poison)."""
        kept = [KeptActivations(self.spec, self.dev, n) for _ in range(self.hosted)]
        if self.poison_outputs:
            for k in kept:
                for t in k.tensors():
                    t.fill_(float("nan"))
        return kept

    def side_by_side(self, hosted, launch) -> None:
        """`launch(i)` for every hosted rank, each on its own stream forked from and joined
        back into the current one: virtual ranks whose plan fits their megakernels side by
        side run at once (side_by_side_ranks), as real ranks do. One rank: in place."""
        if len(hosted) == 1:
            launch(hosted[0])
            return
        main = self._stream()
        if self._side_streams is None:
            self._side_streams = [torch.cuda.Stream(self.dev) for _ in hosted]
        for st in self._side_streams:
            st.wait_stream(main)
        for i, st in zip(hosted, self._side_streams):
            with torch.cuda.stream(st):
                launch(i)
        for st in self._side_streams:
            main.wait_stream(st)

    def routes_of(self, i, n):
        """Hosted rank i's routes of its n tokens (global experts int32 [n, k], weights fp32
        [n, k]) as gathered by the last call: copies, the tables are rewritten by the next."""
        r, K = self.peers.hosted_ranks[i], self.spec.topk
        b = self.ranks[i]
        return (b.routes[r, : n * K].view(n, K).clone(), b.weights[r, : n * K].view(n, K).clone())

    def forward_rank(self, i, xs, logits, w1s, w2s, shared_w1, shared_w2, save=False):
        """Hosted rank i's own work alone (route, schedule, experts, sum), reusing the other
        ranks' routes and combine rows from an earlier full call: the per-rank slice of an
        EP deployment that benchmarks time on one GPU. keep_h plans with save keep the call's
        h in `slice_kept` (a new KeptActivations each call, as a differentiable call makes),
        which backward_rank reads."""
        n = xs[0].shape[0]
        # keep_h plans: the slice's kept activations, which its backward_rank then reads
        self.slice_kept = self.new_kept(n)[i] if self.spec.keep_h and save else None
        self.generation += 1
        self.saved = save
        self.ranks[i].counters.zero_()
        self.quantize_x(i, xs[i])
        self.route(i, logits[i], n)
        self.schedule(i, n)
        self.experts(i, xs[i], self.peer_rows(xs), w1s[i], w2s[i], shared_w1, shared_w2,
                     save, self.slice_kept)
        return self.combine_sum(i, n)

    def quantize_x(self, i, x):
        """fp8 plans: rank i's tokens into its peer-readable e4m3 rows + scales (xq), once,
        before any peer pulls them (before the barrier)."""
        if self.f_quant_x is None:
            return
        n = x.shape[0]
        cuda.launch(self.f_quant_x, warp_per_token_grid(n), 256, 0, self._stream(),
                    [x, n, self.peers.local(i)["xq"], cuda.I64(self.xq_scales_at)])

    def peer_rows(self, xs) -> list:
        """Where the comm CTAs pull every rank's token rows from: their x (a real rank stages
        its own in symmetric memory) or, for fp8 plans, their quantized rows (quantize_x; x
        itself is then not staged: the forward pulls none of it)."""
        return self.peers.ptrs["xq"] if self.spec.scale_block else self.peers.x_pointers(xs)

    @property
    def xq_scales_at(self) -> int:
        return self.spec.tokens_per_rank * self.spec.hidden

    def _route_tables(self):
        """Every rank's gathered route and weight tables (RouteTables<R>, by value)."""
        return cuda.Raw(self.peers.table("routes") + self.peers.table("weights"))

    def route(self, i, logits, n):
        """Softmax top-k of rank i's tokens, written into every rank's gathered tables."""
        self.prologue.route(self._stream(), logits, n, self.peers.hosted_ranks[i],
                            self._route_tables())

    def router_backward(self, logits, experts, dweights):
        """The gradient of one rank's router logits [n, E] (fp32) from the weights' dweights
        [n, k] of its routes experts [n, k] (one kernel: route.cuh router_backward_tokens;
        mokgen.reference.router_backward is the math)."""
        z = logits.float().contiguous()
        e = experts.int().contiguous()
        dw = dweights.float().contiguous()
        if z.shape[1] != self.spec.num_experts or e.shape != dw.shape or \
                e.shape != (z.shape[0], self.spec.topk):
            raise ValueError(f"router_backward: logits [n, {self.spec.num_experts}], experts "
                             f"and dweights [n, {self.spec.topk}]; got {tuple(z.shape)}, "
                             f"{tuple(e.shape)}, {tuple(dw.shape)}")
        out = self.output(tuple(z.shape), torch.float32)
        self.prologue.router_backward(self._stream(), z, e, dw, out)
        return out

    def route_given(self, i, experts, weights, n):
        """The caller's routes of rank i's tokens, written into every rank's tables."""
        self.prologue.route_given(self._stream(), experts, weights, n,
                                  self.peers.hosted_ranks[i], self._route_tables())

    def schedule(self, i, n):
        """Algorithm 1 for rank i from the gathered routes (three small kernels)."""
        self.prologue.schedule(self._stream(), self.ranks[i], n, self.spec.ep,
                               self.peers.hosted_ranks[i])

    def experts(self, i, x, x_ptrs, w1, w2, shared_w1, shared_w2, save=False, kept=None):
        """The megakernel of rank i: dispatch, shared + routed experts, push combine; h (and
        the shared expert's activations) into `kept` where given (keep_h)."""
        s, b = self.spec, self.ranks[i]
        n, L, I, D = x.shape[0], s.local_experts, s.intermediate, s.hidden
        ring_h, hs_pre, h_shared = activation_buffers(b, kept)
        IS = h_shared.shape[1]
        sw1 = shared_w1 if shared_w1 is not None else h_shared  # unused placeholders
        sw2 = shared_w2 if shared_w2 is not None else h_shared
        down_box = 128 if self.fwd_cluster > 1 else 256
        maps = {"x": self._map(x, n, D, 128), "hs": self._map(h_shared, n, IS, 128),
                # gathered rows: no ring_x, a map of x in its place (unread)
                "ring_x": self._map(x, n, D, 128) if b.ring_x is None else
                self._map(b.ring_x, b.ring_x.shape[0], D, 128),
                "ring_a": self._map(b.ring_a, s.macrobatch, I, 128),
                "sw1": self._map(sw1, sw1.shape[0], sw1.shape[1], 128),
                # multicast pairs load a down tile's weight rows as two halves (moe_fwd.cuh
                # down_b_row1)
                "sw2": self._map(sw2, sw2.shape[0], sw2.shape[1], down_box),
                "w1": self._map(w1, L * 2 * I, D, 128), "w2": self._map(w2, L * D, I, down_box)}
        f8, fp8_fields = self._fp8_operands(b, w1, w2)
        peer_table = cuda.Raw(struct.pack(f"<{s.ep}Q", *x_ptrs) + self.peers.table("combine"))
        bufs = abi.pack(abi.FWD_BUFFERS, table=b.table, row_weight=b.row_weight, meta=b.meta,
                        offsets=b.offsets, ring_x=b.ring_x, ring_a=b.ring_a,
                        ring_h=ring_h if save else None, h_shared=h_shared,
                        # the shared expert's pre-activations, which a bf16 backward reads
                        # where resident (moe_bwd.cuh BwdSchedule::shared_kept)
                        hs_pre=hs_pre if save and not s.scale_block else None,
                        y_shared=b.y_shared, counters=b.counters, **fp8_fields, n_tokens=n,
                        max_minibatches=s.max_minibatches, rank=self.peers.hosted_ranks[i])
        cuda.launch(self.f_fwd, self.fwd_ctas, 384, self.fwd_smem, self._stream(),
                    [maps[k] for k in abi.FWD_MAPS] + [f8, peer_table, cuda.Raw(bufs)],
                    cooperative=True, cluster=self.fwd_cluster)

    def _fp8_operands(self, b, w1, w2):
        """The fp8 forward's Fp8Maps (by value) and its FwdBuffers fields; zero maps and
        null pointers for bf16 plans."""
        s, q = self.spec, self.spec.scale_block
        if not q:
            return (cuda.Raw(bytes(len(abi.FP8_MAPS) * abi.TENSOR_MAP_BYTES)),
                    dict.fromkeys(("ring_x8", "ring_a8", "ring_sx", "ring_sa", "w1s", "w2s",
                                   "xq_scales_at"), 0))
        L, D, I, M = s.local_experts, s.hidden, s.intermediate, s.macrobatch
        PD, PI = padded(D), padded(I)  # the weights' padded widths (pad_weight)
        w = self.weights.get(w1, w2)
        maps = self.fp8_maps(abi.FP8_MAPS,
                             {"ring_x": (b.ring_x8, M, D), "ring_a": (b.ring_a8, M, I),
                              "w1": (w.w1, L * 2 * PI, PD), "w2": (w.w2, L * PD, PI)},
                             {"ring_sx": (b.ring_sx, D, M), "ring_sa": (b.ring_sa, I, M)},
                             {"w1s": (w.s1, PD, L * 2 * PI), "w2s": (w.s2, PI, L * PD)})
        blockwise = q == 128
        return maps, dict(ring_x8=b.ring_x8, ring_a8=b.ring_a8, ring_sx=b.ring_sx,
                          ring_sa=b.ring_sa, w1s=w.s1 if blockwise else None,
                          w2s=w.s2 if blockwise else None, xq_scales_at=self.xq_scales_at)

    def fp8_maps(self, names, operands, scales, weight_scales) -> cuda.Raw:
        """An fp8 kernel's map struct by value (abi.FP8_MAPS, FP8_BWD_MAPS) from maps by
        field name: the e4m3 operands (tensor, rows, K), boxes of 128 K bytes x 128 rows; the
        activations' fp32 scales (tensor, K, rows), laid out [ceil(K/q), rows], boxes of 128
        rows x one slice's 128/q steps (TMA zero-fills the steps past a K tail, whose data it
        zero-fills too); the weights' scales the same way (MX only: blockwise B scales are read
        from global memory, and their slots hold an activation map, unused)."""
        q = self.spec.scale_block
        scale_map = lambda t, k, rows: self._map(t, -(-k // q), rows, 128 // q, 128,  # noqa: E731
                                                 dtype="f32", swizzle=0)
        maps = {k: self._map(t, rows, kk, 128, 128, dtype="u8")
                for k, (t, rows, kk) in operands.items()}
        maps.update({k: scale_map(*v) for k, v in scales.items()})
        unused = next(iter(maps.values()))
        maps.update({k: scale_map(*v) if q == 32 else unused for k, v in weight_scales.items()})
        return cuda.Raw(abi.pack_maps(names, maps, cuda.tensor_map_bytes))

    def combine_sum(self, i, n, at=None):
        """Owner side: y = shared + the k pushed rows of each token, in route order. (The
        backward reuses it: dx = shared dx + the k pushed dx rows; y_shared holds that.)
        `at=(rows, pos)`: route r's row is rows[pos[r]] instead of the combine rows' r-th
        (the backward's dx rows left in its dy ring, reverse_dispatch "ring")."""
        s, b = self.spec, self.ranks[i]
        y = self.output((n, s.hidden), BF16)
        f, rows = (self.f_sum, [b.combine]) if at is None else (self.f_sum_at, list(at))
        cuda.launch(f, max(1, min(4096, -(-n * s.hidden // 8 // 256))), 256, 0,
                    self._stream(), rows + [b.y_shared if s.shared_dim else None, y, n])
        return y

    def output(self, shape, dtype):
        """A fresh output tensor: NaN-filled after poison() (tests see unwritten elements)."""
        if self.poison_outputs:
            return torch.full(shape, float("nan"), dtype=dtype, device=self.dev)
        return torch.empty(shape, dtype=dtype, device=self.dev)
