"""The layer's device workspace: every buffer the megakernels use during a call, sized from a
`LayerSpec` alone, and the pool that shares one workspace among all layers that fit it.

A model has tens of MoE layers of one shape. Nothing in the workspace outlives a call except
what the ring holds for the layer that ran forward last (docs/design.md, "Models, not layers"), so
every layer of a spec on a device (and group) uses one workspace: `shared(key, make)` hands
out the live one or makes it, and a workspace is freed when its last layer goes (the pool
holds weak references only).

The constructors below are also run on the meta device to size the workspace without a GPU
(`workspace_bytes`): the plan's memory report and the allocation are the same code.
Imports torch only (no driver), so the compiler side can size a plan on any machine.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from mokgen.runtime.abi import padded, sched_chunks
from mokgen.runtime.peers import peer_shapes

BF16 = torch.bfloat16


@dataclass(frozen=True)
class LayerSpec:
    num_experts: int
    hidden: int
    intermediate: int
    shared_dim: int
    topk: int
    ep: int
    tokens_per_rank: int
    block_m: int
    minibatch: int
    macrobatch: int
    comm_sms: int
    max_rows: int
    comm_sms_bwd: int = 0
    scale_block: int = 0  # routed experts in fp8: elements per scale along K (128 or 32)
    block_n: int = 256  # the backward's GEMM tile N: plan.gemm_bwd.bn (checked against the cubin)
    # the comm ops' directions (the cubin is built for them): the paper's, or the ways that
    # move nothing (mokgen/compiler/limits.py GATHER, RING)
    dispatch: str = "pull"
    combine: str = "push"
    reverse_combine: str = "pull"
    reverse_dispatch: str = "push"
    # the backward's x ring as a window of this many minibatch slots (passes/x_window.py,
    # FwdConsts XSLOTS); 0: the ring's own
    x_slots: int = 0
    # each differentiable call keeps its own h (KeptActivations) instead of the ring's
    keep_h: bool = False

    @property
    def gather(self) -> bool:
        """No x or dy ring: both directions' GEMMs gather those rows from the caller's tensors
        (one rank, bf16; mokgen/compiler/limits.py GATHER). A forward that gathers alone
        (reverse_combine "pull") leaves both rings to the backward."""
        return self.reverse_combine == "gather"

    @property
    def dx_ring(self) -> bool:
        """The dx tiles leave their rows over their dy rows in the ring (reverse_dispatch
        "ring", moe_bwd.cuh DXRING), which then lives in the combine rows
        (peers.combine_rows): the forward is done with those once it summed them, and the
        backward writes none (its dx sum gathers the ring's rows)."""
        return self.reverse_dispatch == "ring"

    @property
    def x_rows(self) -> int:
        """Rows of the x ring (moe_bwd.cuh FwdConsts X_ROWS; checked against the cubin)."""
        return self.x_slots * self.minibatch if self.x_slots else self.macrobatch

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep

    @property
    def max_minibatches(self) -> int:
        return -(-self.max_rows // self.minibatch)

    @property
    def needs_wg_acc(self) -> bool:
        """Whether an expert's rows can span several passes of the ring: only then does the
        backward sum its weight gradients over segments in fp32 (schedule.cuh,
        schedule_segments: a ring that holds every minibatch takes each expert whole)."""
        return self.max_minibatches > self.macrobatch // self.minibatch

    @property
    def wg_by_minibatch(self) -> bool:
        """Where the backward keeps an expert's fp32 weight-gradient sum (moe_bwd.cuh
        wgrad_epilogue, BwdBuffers::wg_by_minibatch): true, in the slot of the minibatch its
        rows start in (only an expert whose rows span several minibatches has a sum, and only
        the last expert starting in a minibatch can reach past it: a slot per minibatch but
        the last one); false, in its own (fewer local experts than that)."""
        return self.max_minibatches - 1 < self.local_experts

    @property
    def wg_acc_slots(self) -> int:
        """Running sums [3 I D] the backward's wg_acc holds (wg_by_minibatch says whose)."""
        return min(self.local_experts, self.max_minibatches - 1)

    def counter_words(self) -> int:
        shared_rt = -(-self.tokens_per_rank // self.block_m)
        return 1 + 2 * self.max_minibatches + self.max_minibatches * (
            self.minibatch // self.block_m) + shared_rt


class RankBuffers:
    """One hosted rank's forward state (its schedule, ring and shared-expert scratch); the
    backward reads the same rings. Buffers peers write into are allocated by the PeerSet."""

    def __init__(self, spec: LayerSpec, dev, peer: dict):
        s, R, N = spec, spec.ep, spec.tokens_per_rank
        L, K = s.local_experts, s.topk
        i32 = dict(dtype=torch.int32, device=dev)
        self.routes, self.weights, self.combine = peer["routes"], peer["weights"], peer["combine"]
        self.dweight = peer["dweight"]  # router-weight gradients pushed by the backward
        # the schedule's count kernel: each route's ordinal inside its chunk of SCHED_CHUNK
        # routes, and per (source rank, chunk) its routes to each local expert, which the
        # offsets kernel turns into the chunk's base (runtime/prologue.py, schedule.cuh)
        self.ordinal = torch.empty(R * N * K, **i32)
        self.chunk_counts = torch.empty(R * sched_chunks(N * K) * L, **i32)
        self.counts = torch.empty(R * L, **i32)
        self.offsets = torch.empty(L + 1, **i32)
        self.meta = torch.empty(4, **i32)
        self.table = torch.empty(s.max_rows, 2, **i32)
        self.row_weight = torch.empty(s.max_rows, dtype=torch.float32, device=dev)
        # None when gathered: the kernels read the caller's x (null pointer, unread)
        self.ring_x = None if s.gather else torch.empty(s.x_rows, s.hidden, dtype=BF16,
                                                        device=dev)
        self.ring_a = torch.empty(s.macrobatch, s.intermediate, dtype=BF16, device=dev)
        # keep_h: none here, each differentiable call's own (KeptActivations)
        self.ring_h = None if s.keep_h else \
            torch.empty(s.macrobatch, 2 * s.intermediate, dtype=BF16, device=dev)
        # the shared expert's SwiGLU output (the forward always writes it) and its gate/up
        # pre-activations (written when a bf16 backward follows, which then reads both as it
        # reads the ring, or recomputes both here when another forward ran since or in fp8
        # plans); its dh lands over hs_pre
        IS = max(s.shared_dim, 64)
        self.h_shared = torch.empty(N, IS, dtype=BF16, device=dev)
        self.hs_pre = torch.empty(N, 2 * IS, dtype=BF16, device=dev)
        # the shared expert's fp32 output (forward) and dx (backward); unread without one
        self.y_shared = torch.empty(N if s.shared_dim else 1, s.hidden, dtype=torch.float32,
                                    device=dev)
        self.counters = torch.empty(s.counter_words(), **i32)
        q, M = s.scale_block, s.macrobatch
        if q:  # the routed experts' e4m3 rings and their scales (fp8.cuh)
            f32 = dict(dtype=torch.float32, device=dev)
            self.ring_x8 = torch.empty(M, s.hidden, dtype=torch.uint8, device=dev)
            self.ring_a8 = torch.empty(M, s.intermediate, dtype=torch.uint8, device=dev)
            self.ring_sx = torch.empty(-(-s.hidden // q), M, **f32)  # a partial block: one
            self.ring_sa = torch.empty(-(-s.intermediate // q), M, **f32)


class KeptActivations:
    """What one differentiable call of a keep_h plan keeps for its own backward, allocated by
    its forward (the caching allocator's, freed with the autograd graph): the gate/up
    pre-activations in ring layout (the kernels' ring_h, over which the backward writes dh)
    and, with a shared expert, its pre-activations and SwiGLU output (RankBuffers' hs_pre and
    h_shared otherwise). So a backward finds its forward's h whatever other layers sharing
    the workspace ran between, and never replays gate/up; it pulls x (FwdConsts XPULL)."""

    def __init__(self, spec: LayerSpec, dev, n_tokens: int):
        made = [torch.empty(shape, dtype=BF16, device=dev)
                for shape in self.shapes(spec, n_tokens)]
        self.ring_h, self.hs_pre, self.h_shared = made + [None] * (3 - len(made))

    @staticmethod
    def shapes(spec: LayerSpec, n_tokens: int) -> list:
        """The bf16 tensors' shapes, in tensors() order: h [kept_rows, 2 I] and, with a
        shared expert, its pre-activations [n, 2 I_s] and output [n, I_s]."""
        IS = spec.shared_dim
        return [(KeptActivations.kept_rows(spec, n_tokens), 2 * spec.intermediate)] + \
            ([(n_tokens, 2 * IS), (n_tokens, IS)] if IS else [])

    @staticmethod
    def kept_rows(spec: LayerSpec, n_tokens: int) -> int:
        """Ring rows a call of n tokens can fill: keep_h plans' ring holds every minibatch
        (one rank), so a row's ring row is its layout row, below the schedule's padded row
        count (schedule.cuh offsets: each local expert's region rounded up to the tile,
        BM-aligned, every route local), at most n k + L (BM - 1). So a call with fewer tokens
        than the plan's keeps as much less (the ring's macrobatch is the plan's worst case)."""
        bm = spec.block_m
        bound = n_tokens * spec.topk + spec.local_experts * (bm - 1)
        return min(spec.macrobatch, -(-bound // bm) * bm)

    def tensors(self) -> list:
        return [t for t in (self.ring_h, self.hs_pre, self.h_shared) if t is not None]

    @classmethod
    def of(cls, tensors: list) -> "KeptActivations":
        """The object `tensors()` came from (the custom ops carry the tensors)."""
        k = cls.__new__(cls)
        k.ring_h, *shared = tensors
        k.hs_pre, k.h_shared = shared if shared else (None, None)
        return k


def activation_buffers(rank: "RankBuffers", kept: KeptActivations | None) -> tuple:
    """(ring_h, hs_pre, h_shared) a call's h and shared-expert activations live in: the
    kept ones where given (keep_h; the shared expert's only with one), else the rank's."""
    ring_h, hs_pre, h_shared = rank.ring_h, rank.hs_pre, rank.h_shared
    if kept is not None:
        ring_h = kept.ring_h
        if kept.h_shared is not None:
            hs_pre, h_shared = kept.hs_pre, kept.h_shared
    return ring_h, hs_pre, h_shared


def kept_bytes(spec: LayerSpec, tokens: int) -> int:
    """Bytes KeptActivations holds per call (0 unless keep_h)."""
    if not spec.keep_h:
        return 0
    return sum(a * b for a, b in KeptActivations.shapes(spec, tokens)) * 2


class BackwardScratch:
    """The backward's own buffers, shared by the hosted ranks (their kernels run one after
    another): the ring of dy (the combine rows where dx rows stay in it, LayerSpec.dx_ring;
    dh and w * a go over the forward's h and a rings, which the backward consumes:
    moe_bwd.cuh; the shared expert's dh over its pre-activations in RankBuffers likewise),
    each route's ring row where dx rows stay in the dy ring, the tables of weight-gradient
    segments and, only where an expert's rows can span several ring passes
    (`LayerSpec.needs_wg_acc`), the fp32 running sums of its weight gradients
    (`LayerSpec.wg_acc_slots` of them)."""

    def __init__(self, spec: LayerSpec, dev, ring_dy=None):
        s = spec
        M, D, I, L = s.macrobatch, s.hidden, s.intermediate, s.local_experts
        e = dict(dtype=BF16, device=dev)
        # dx rows in it: the combine rows (LayerSpec.dx_ring), given
        # gathered: none (the kernels read the caller's dy)
        self.ring_dy = ring_dy if ring_dy is not None else None if s.gather else \
            torch.empty(M, D, **e)
        # dx rows in the dy ring: each route's ring row, for the dx sum (combine_sum_at)
        self.pos = torch.empty(s.tokens_per_rank * s.topk, dtype=torch.int32, device=dev) \
            if s.dx_ring else None
        self.dw_part = torch.empty(s.max_rows, backward_tiles(s)[0], dtype=torch.float32,
                                   device=dev)
        # None: the kernel gets a null pointer and never reads it (every segment is whole)
        self.wg_acc = (torch.empty(s.wg_acc_slots, 3 * I * D, dtype=torch.float32, device=dev)
                       if s.needs_wg_acc else None)
        self.segs = torch.empty(s.max_minibatches + L, 4, dtype=torch.int32, device=dev)
        self.seg_start = torch.empty(s.max_minibatches + 2, dtype=torch.int32, device=dev)
        self.counters = torch.empty(backward_counter_words(s), dtype=torch.int32, device=dev)
        q = s.scale_block
        if q:  # the fp8 backward's e4m3 rings of dy and dh and their scales [K/q, M]; dh's
            # d gate and d up each padded to whole 128-blocks (moe_bwd.cuh swiglu_backward_fp8)
            u8, f32 = dict(dtype=torch.uint8, device=dev), dict(dtype=torch.float32, device=dev)
            self.ring_dy8 = torch.empty(M, D, **u8)
            self.ring_sdy = torch.empty(-(-D // q), M, **f32)
            self.ring_dh8 = torch.empty(M, 2 * padded(I), **u8)
            self.ring_sdh = torch.empty(2 * padded(I) // q, M, **f32)


def backward_tiles(s: LayerSpec) -> tuple[int, int]:
    """(dgrad tiles across I, weight-gradient tiles per expert) of the backward kernel
    (moe_bwd.cuh BwdSchedule DG_N, WT: block_n x block_m dgrad tiles, block_m x block_n
    weight-gradient tiles, the last ones masked where a width is not a multiple); the runtime
    checks them against the cubin's mokgen_bwd_tiles."""
    up = lambda a, b: -(-a // b)  # noqa: E731 - edge tiles round every count up
    bn, bm = s.block_n, s.block_m
    return up(s.intermediate, bn), \
        up(s.hidden, bm) * up(s.intermediate, bn) + up(2 * s.intermediate, bm) * up(s.hidden, bn)


def backward_counter_words(s: LayerSpec) -> int:
    """moe_bwd.cuh BwdProblem's counters, in its order; dx rows in the dy ring add a count
    per expert of its dW2 tiles done (wg2_done), an x window one of its dW1 tiles (wg1_done)."""
    mb, rt_full = s.max_minibatches, s.minibatch // s.block_m
    srt = -(-s.tokens_per_rank // s.block_m)
    return 1 + mb * (2 + 2 * rt_full) + s.local_experts * backward_tiles(s)[1] + 2 * srt + 2 \
        + (s.local_experts if s.dx_ring else 0) + (s.local_experts if s.x_slots else 0)


def backward_ring_dy(spec: LayerSpec, peer: dict):
    """The dy ring BackwardScratch gets from one rank's peer buffers `peer`: the combine rows
    (dx rows in it), or None (its own, or none when gathered)."""
    return peer["combine"][: spec.macrobatch] if spec.dx_ring else None


def tensors_of(*things) -> list:
    """The distinct tensors among `things`: tensors, lists of them, or objects holding them
    as attributes (buffers, peer tables). A view counts as the tensor it views (the dy ring
    in the combine rows: BackwardScratch), so each allocation is counted once. A work list,
    not a recursive closure: a closure that calls itself is a reference cycle, which would
    keep the tensors it saw alive until the garbage collector runs (a released workspace)."""
    seen, out = set(), []
    todo = [(t, 0) for t in reversed(things)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, torch.Tensor):
            v = v if v._base is None else v._base
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
        elif isinstance(v, (list, tuple)):
            todo.extend((t, depth) for t in reversed(v))
        elif depth == 0 and hasattr(v, "__dict__"):
            todo.extend((t, 1) for t in reversed(list(vars(v).values())))
    return out


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def workspace_bytes(spec: LayerSpec) -> dict:
    """Bytes of one real rank's workspace by part, sized on the meta device (no GPU needed):
    `peer` (what peers read or write: routes, combine rows, staged x and dy), `forward`
    (schedule, ring, shared-expert scratch), `backward` (BackwardScratch) and `total`. A GPU
    hosting R virtual ranks holds R times peer (less the staging) + forward, and one backward
    (R of them when the ranks' backward megakernels run side by side)."""
    meta = torch.device("meta")
    peer = {k: torch.empty(*shape, dtype=dt, device=meta)
            for k, (shape, dt) in peer_shapes(spec).items()}
    fwd = [t for t in tensors_of(RankBuffers(spec, meta, peer))
           if not any(t is p for p in peer.values())]
    parts = {"peer": nbytes(peer.values()), "forward": nbytes(fwd),
             "backward": nbytes([t for t in tensors_of(BackwardScratch(
                 spec, meta, backward_ring_dy(spec, peer)))
                 if not any(t is p for p in peer.values())])}
    parts["total"] = sum(parts.values())
    return parts


def saved_bytes(spec: LayerSpec, tokens: int, by_logits: bool = True) -> int:
    """Bytes one layer keeps per call for its backward besides the ring: its input x (bf16),
    router logits (fp32, when mokgen routes), routes (int32 experts + fp32 weights) and,
    keep_h plans, its own h (KeptActivations)."""
    n, K = tokens, spec.topk
    return n * spec.hidden * 2 + (n * spec.num_experts * 4 if by_logits else 0) + n * K * 8 \
        + kept_bytes(spec, n)


# ---------------------------------------------------------------- the pool
_POOL: dict = {}
# Re-entrant: make() allocates, an allocation may run the garbage collector, and the collector
# runs _forget (a dead pooled object's weakref callback) on this thread while shared() holds
# the lock. A plain Lock deadlocked there (seen on the GPU: test_gpu_widths hung in _forget).
_LOCK = threading.RLock()


def shared(key, make):
    """The live object made for `key`, or `make()` registered under it. Weak: the object
    goes when its last holder does, and a later call makes a fresh one."""
    with _LOCK:
        ref = _POOL.get(key)
        obj = ref() if ref is not None else None
        if obj is None:
            obj = make()
            _POOL[key] = weakref.ref(obj, lambda r, k=key: _forget(k, r))
        return obj


def _forget(key, ref) -> None:
    with _LOCK:
        if _POOL.get(key) is ref:
            del _POOL[key]


def live_workspaces() -> int:
    """How many pooled objects (forward and backward runtimes) are alive."""
    with _LOCK:
        return sum(r() is not None for r in _POOL.values())
