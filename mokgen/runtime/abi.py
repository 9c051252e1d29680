"""The host <-> device interface, described once.

The kernels take structs by value (FwdBuffers, BwdBuffers, BwdMaps, Fp8Maps, Fp8BwdMaps) and
report watchdog phases by number. This module is the one description of them: the host packs
every struct from it by field name (`pack`, `pack_maps`: a missing or unknown name is an
error, never a shifted field), and codegen renders from it the static_asserts that fail the
build when a header's struct drifts (`mokgen.compiler.codegen.abi_checks`: offset of every field and
the struct's size; the value of every phase constant). The runtime imports nothing from the
compiler: codegen reads this module, not the other way round.
"""
from __future__ import annotations

import functools
import struct

# (field, kind): "ptr" (a device pointer, 8 bytes), "u64", "i32"; in declaration order.
FWD_BUFFERS = (
    ("table", "ptr"), ("row_weight", "ptr"), ("meta", "ptr"), ("offsets", "ptr"),
    ("ring_x", "ptr"), ("ring_a", "ptr"), ("ring_h", "ptr"), ("h_shared", "ptr"),
    ("hs_pre", "ptr"), ("y_shared", "ptr"), ("counters", "ptr"),
    ("ring_x8", "ptr"), ("ring_a8", "ptr"), ("ring_sx", "ptr"), ("ring_sa", "ptr"),
    ("w1s", "ptr"), ("w2s", "ptr"), ("xq_scales_at", "u64"),
    ("n_tokens", "i32"), ("max_minibatches", "i32"), ("rank", "i32"),
)
BWD_BUFFERS = (
    ("table", "ptr"), ("row_weight", "ptr"), ("meta", "ptr"), ("offsets", "ptr"),
    ("segs", "ptr"), ("seg_start", "ptr"), ("ring_x", "ptr"), ("ring_h", "ptr"),
    ("ring_a", "ptr"), ("ring_dy", "ptr"), ("dw_part", "ptr"), ("hs_pre", "ptr"),
    ("hs_a", "ptr"),
    ("dx_shared", "ptr"), ("dw1", "ptr"), ("dw2", "ptr"), ("dsw1", "ptr"), ("dsw2", "ptr"),
    ("wg_acc", "ptr"), ("counters", "ptr"),
    ("ring_x8", "ptr"), ("ring_sx", "ptr"), ("ring_dy8", "ptr"), ("ring_sdy", "ptr"),
    ("ring_dh8", "ptr"), ("ring_sdh", "ptr"), ("w1s", "ptr"), ("w2ts", "ptr"), ("w1ts", "ptr"),
    ("n_tokens", "i32"), ("max_minibatches", "i32"), ("rank", "i32"), ("resident", "i32"),
    ("accumulate", "i32"), ("wg_by_minibatch", "i32"), ("wgrad_tma", "i32"),
)
# Tensor-map structs: CUtensorMap fields in declaration order. The forward's bf16 maps are
# kernel parameters of their own (codegen renders the parameter list from FWD_MAPS).
FWD_MAPS = ("x", "hs", "ring_x", "ring_a", "sw1", "sw2", "w1", "w2")
BWD_MAPS = ("x_k", "sw1_k", "dy_k", "sw2_mn", "hs_dh_k", "sw1_mn", "dy_mn", "hs_a_mn",
            "hs_dh_mn", "x_mn", "ring_x_k", "w1_k", "ring_dy_k", "w2_mn", "ring_dh_k", "w1_mn",
            "ring_dy_mn", "ring_a_mn", "ring_dh_mn", "ring_x_mn", "dw1_st", "dw2_st")
FP8_MAPS = ("ring_x", "ring_a", "w1", "w2", "ring_sx", "ring_sa", "w1s", "w2s")
FP8_BWD_MAPS = ("ring_x", "w1", "ring_dy", "w2t", "ring_dh", "w1t", "ring_sx", "ring_sdy",
                "ring_sdh", "w1s", "w2ts", "w1ts")
STRUCTS = {"FwdBuffers": FWD_BUFFERS, "BwdBuffers": BWD_BUFFERS}
MAP_STRUCTS = {"BwdMaps": BWD_MAPS, "Fp8Maps": FP8_MAPS, "Fp8BwdMaps": FP8_BWD_MAPS}
TENSOR_MAP_BYTES = 128

# The watchdog's record (sync.cuh WatchWord) and the phases a wait reports (moe_fwd.cuh
# FwdPhase, moe_bwd.cuh BwdPhase): constant -> (value, what was waiting).
WATCH_WORDS, WATCH_MAGIC = 8, 0x57A7C400
WATCH_FIELDS = ("kWatchCode", "kWatchRank", "kWatchPhase", "kWatchIndex", "kWatchValue",
                "kWatchTarget", "kWatchBlock")
FWD_PHASES = {
    "kPhaseSharedDown": (1, "a shared-expert down tile waiting for its gate/up tiles "
                            "(row tile {index})"),
    "kPhaseGateUp": (2, "a gate/up tile waiting for minibatch {index}'s rows from the comm CTAs"),
    "kPhaseDown": (3, "a down tile waiting for its gate/up tiles (row tile {index})"),
    "kPhaseRingSlot": (4, "a comm CTA waiting for minibatch {index} to free its ring slot"),
}
BWD_PHASES = {
    "kPhaseSDgrad": (11, "a shared-expert dgrad tile waiting for its gate/up recompute "
                         "(row tile {index})"),
    "kPhaseSDx": (12, "a shared-expert dx tile waiting for its dgrad tiles (row tile {index})"),
    "kPhaseSWgrad": (13, "a shared-expert weight-gradient tile waiting for the activations"),
    "kPhaseReplay": (14, "a replay tile waiting for minibatch {index}'s rows from the comm CTAs"),
    "kPhaseDgrad": (15, "a dgrad tile waiting for minibatch {index}'s dy rows or its replay"),
    "kPhaseDx": (16, "a dx tile waiting for minibatch {index}'s dgrad tiles"),
    "kPhaseWgrad": (17, "a weight-gradient tile waiting for minibatch {index}'s dgrad tiles"),
    "kPhaseWgradOrder": (18, "a weight-gradient tile waiting for the previous segment of its "
                             "expert (tile {index})"),
    "kPhaseDxRing": (21, "a dx tile waiting for expert {index}'s dW2 tiles to read the dy rows "
                         "it writes over (reverse_dispatch 'ring')"),
    "kPhaseBwdRingSlot": (19, "a backward comm CTA waiting for minibatch {index} to free its "
                              "ring slot"),
    "kPhaseXSlot": (22, "a backward comm CTA waiting for expert {index}'s dW1 tiles to read "
                        "the x rows of the window slot it refills (x_slots; it can wait "
                        "forever only where routes repeat an expert within a token)"),
}
PHASES = {**FWD_PHASES, **BWD_PHASES}
BARRIER_PHASE = (100, "the rank barrier, waiting for peer rank {index}")  # sync.cuh barrier


def phase_text(code: int) -> str:
    for value, text in (*PHASES.values(), BARRIER_PHASE):
        if value == code:
            return text
    return f"phase {code}"


# Timing-only kernel variants a plan may ask for (Plan.profile): name -> the bit of
# gemm_types.cuh's Profile that codegen sets in GemmCfg's PROF.
PROFILES = {"no_routed_wgrad": ("kProfNoRoutedWgrad", 1), "no_dh_quant": ("kProfNoDhQuant", 2),
            "fp8_no_promote": ("kProfFp8NoPromote", 4),
            "fp8_plain_epilogue": ("kProfFp8PlainEpilogue", 8),
            "no_wgrad_epilogue": ("kProfNoWgradEpilogue", 16),
            "no_bwd_epilogues": ("kProfNoBwdEpilogues", 32),
            "no_wgrad_waits": ("kProfNoWgradWaits", 64),
            "no_fwd_epilogues": ("kProfNoFwdEpilogues", 128),
            "trace": ("kProfTrace", 256),  # results right: timestamps only (trace.cuh)
            # the routed SwiGLU backward (bf16): no g / u loads (the tile's d_a stands in) /
            # no dh, w a stores: what each costs of its epilogue
            "no_dgrad_loads": ("kProfNoDgradLoads", 512),
            "no_dgrad_stores": ("kProfNoDgradStores", 1024),
            # gathered plans (dispatch="gather"): rows read in order, not through the table
            # (what scattered rows cost the gathering producer) / no proxy fence in the
            # consumers (what it costs them) / one lane a producer warp polling the empty
            # barrier (what 128 pollers cost)
            "gather_in_order": ("kProfGatherInOrder", 2048),
            "gather_no_fence": ("kProfGatherNoFence", 4096),
            "gather_one_waiter": ("kProfGatherOneWaiter", 8192),
            # bf16 mainloops without their wgmma: the ring's fill rate in the megakernel, the
            # tensor core not reading shared memory
            "no_mma": ("kProfNoMma", 16384),
            # the forward's routed gate/up and down epilogues without their stores (values
            # still computed) / the down rows in order, without their table and weight loads
            # (results wrong)
            "fwd_sink_stores": ("kProfFwdSinkStores", 32768),
            "down_in_order": ("kProfDownInOrder", 65536)}


# The megakernels' task opcodes (moe_fwd.cuh FwdOp, moe_bwd.cuh BwdOp), by value: what a
# trace's records name (trace.cuh).
FWD_OPS = {"kSharedGateUp": 0, "kSharedDown": 1, "kGateUp": 2, "kDown": 3}
BWD_OPS = {"kSGateUp": 0, "kSDgrad": 1, "kSDx": 2, "kSWgrad2": 3, "kSWgrad1": 4,
           "kReplay": 5, "kDgrad": 6, "kDx": 7, "kWgrad2": 8, "kWgrad1": 9}
OPCODE_MASK = 0xff  # gemm_types.cuh kOpcodeMask: the opcode's bits of Task::op
F8_TASK = 1 << 10  # gemm_types.cuh kF8: an fp8 tile (its K blocks are 128 wide)
HALF_N_TASK = 1 << 30  # gemm_types.cuh kHalfN: a narrow edge tile (its mainloop is BN/2 wide)

# The `trace` profile's buffer (trace.cuh): kTraceRecs records per CTA of kTraceWords 64-bit
# words, the words in TRACE_FIELDS order (kTrOp: Task::op, K blocks << 32; the rest clocks,
# the last three clock sums over the task's slices: the ring's fill and drain waits).
TRACE_RECS, TRACE_WORDS = 4096, 11
TRACE_FIELDS = ("kTrOp", "kTrAsk", "kTrGot", "kTrPop", "kTrMain", "kTrEpi", "kTrDone",
                "kTrGlobalNs", "kTrFillWait", "kTrFillIssue", "kTrFullWait")


# Routes of one source rank that one block of the schedule's count kernel takes (schedule.cuh
# schedule_count's CHUNK, one thread per route). The host launches ranks x sched_chunks()
# blocks of this many threads and sizes the per-chunk counts by it; the prologue is rendered
# with it and the runtime checks the cubin's copy (mokgen_sched_chunk) on load.
SCHED_CHUNK = 1024


def sched_chunks(routes_per_rank: int) -> int:
    """Chunks of one source rank's routes; at least one, so that a call with no tokens still
    writes (zero) counts."""
    return max(1, -(-routes_per_rank // SCHED_CHUNK))


def padded(n: int) -> int:
    """A width of the fp8 weights (and of dh's halves) in the kernels' layouts: whole
    128-blocks (FwdConsts::PD, PI; the fwd and bwd sources assert they agree:
    codegen.constants)."""
    return -(-n // 128) * 128


def profile_mask(names) -> int:
    return sum(PROFILES[n][1] for n in names)


_FORMAT = {"ptr": "Q", "u64": "Q", "i32": "i"}


def layout(fields) -> tuple[dict, int]:
    """{field: byte offset} and the struct's size under the C ABI (natural alignment,
    size rounded up to the largest member's alignment)."""
    offsets, off, align = {}, 0, 1
    for name, kind in fields:
        size = struct.calcsize(_FORMAT[kind])
        off = -(-off // size) * size
        offsets[name] = off
        off += size
        align = max(align, size)
    return offsets, -(-off // align) * align


def pack(fields, **values) -> bytes:
    """The struct's bytes from field values by name; a pointer may be given as a tensor or
    None (a null pointer)."""
    packer, names = _packer(tuple(fields))
    if values.keys() != names:
        missing, unknown = names - set(values), set(values) - names
        raise ValueError(f"struct fields missing {sorted(missing)}, unknown {sorted(unknown)}")
    ptr = lambda v: v if isinstance(v, int) else 0 if v is None else v.data_ptr()  # noqa: E731
    return packer.pack(*(ptr(values[name]) if kind == "ptr" else values[name]
                         for name, kind in fields))


@functools.lru_cache(maxsize=None)
def _packer(fields: tuple) -> tuple[struct.Struct, frozenset]:
    """`layout` as one compiled struct.Struct (explicit pad bytes, zeros) and the field names:
    a call's two structs are packed on the host's critical path (pack_into with the layout
    recomputed takes ~65 us a struct)."""
    offsets, size = layout(fields)
    fmt, at = "<", 0
    for name, kind in fields:
        fmt += f"{offsets[name] - at}x{_FORMAT[kind]}"
        at = offsets[name] + struct.calcsize(_FORMAT[kind])
    return struct.Struct(fmt + f"{size - at}x"), frozenset(n for n, _ in fields)


def pack_maps(names, maps: dict, encode) -> bytes:
    """A tensor-map struct's bytes from maps by field name; `encode(map) -> 128 bytes`."""
    if set(maps) != set(names):
        raise ValueError(f"tensor maps missing {sorted(set(names) - set(maps))}, "
                         f"unknown {sorted(set(maps) - set(names))}")
    return b"".join(encode(maps[n]) for n in names)
