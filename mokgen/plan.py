"""The Plan: every decision the compiler makes about one MoE layer, frozen.

`plan()` builds the initial Plan from the problem and runs the passes of `mokgen.passes.PASSES`
in order; each pass is a pure function Plan -> Plan that fills in its own fields. A field set
through `overrides` is recorded in `forced` and left alone by its pass (ablations, tuning).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from . import hardware
from .limits import backward_unsupported
from .shapes import MoEShape

DTYPES = ("bf16", "fp8", "mxfp8")
DIRECTIONS = ("pull", "push")
COMM_OPS = ("dispatch", "combine", "reverse_combine", "reverse_dispatch")
BLOCK_M = 128  # GEMM tile rows: two consumer warpgroups of 64 rows (wgmma m64)

# Fields a caller may force. Everything else is derived.
OVERRIDABLE = COMM_OPS + ("comm_sms_fwd", "comm_sms_bwd", "minibatch", "macrobatch",
                          "ring_budget_bytes", "arch", "reserve_sms", "overlap_comm", "profile")


@dataclass(frozen=True)
class Plan:
    shape: MoEShape
    ep: int
    dtype: str
    tokens_per_rank: int
    arch: str = "sm_90a"
    gpu: str = "H200"
    forced: tuple = ()
    block_m: int = BLOCK_M
    # comm_direction
    dispatch: str | None = None
    combine: str | None = None
    reverse_combine: str | None = None
    reverse_dispatch: str | None = None
    signals: tuple = ()          # ((op, direction, local, cross), ...) per minibatch
    # precision
    act_dtype: str | None = None     # what the routed GEMMs read
    shared_dtype: str | None = None  # the shared expert stays bf16
    quant_fused: tuple = ()          # where activation quantization happens
    scale_block: int = 0             # elements per scale along K: 0 (bf16), 128 (fp8), 32 (mx)
    row_bytes: int | None = None     # bytes of one dispatched token row (data + scales)
    # sm_partition
    profile: tuple = ()          # timing-only variants (runtime/abi.py PROFILES): wrong results
    overlap_comm: bool = False   # the user runs collectives (FSDP gathers) beside the layer
    reserve_sms: int = 0         # SMs left free for them: no CTA of the megakernels runs there
    num_sms: int | None = None   # CTAs of each persistent launch: the GPU's SMs - reserve_sms
    comm_sms_fwd: int | None = None
    comm_sms_bwd: int | None = None
    # granularity
    minibatch: int | None = None
    # ring
    ring_budget_bytes: int = 4 << 30
    macrobatch: int | None = None
    ring_bytes: int | None = None
    max_routed_rows: int | None = None     # worst case rows one rank can receive (padded)
    expected_routed_rows: int | None = None
    expected_replay_rows: int | None = None
    notes: tuple = field(default=(), compare=False)

    # ------------------------------------------------------------------ derived
    @property
    def local_experts(self) -> int:
        return self.shape.local_experts(self.ep)

    @property
    def ring_slots(self) -> int:
        return self.macrobatch // self.minibatch

    def replace(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)

    def note(self, text: str) -> "Plan":
        return self.replace(notes=self.notes + (text,))

    def is_forced(self, name: str) -> bool:
        return name in self.forced

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["shape"] = self.shape.to_dict()
        d["signals"] = [list(s) for s in self.signals]
        for key in ("forced", "quant_fused", "notes", "profile"):
            d[key] = list(d[key])
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        d["shape"] = MoEShape.from_dict(d["shape"])
        d["signals"] = tuple(tuple(s) for s in d["signals"])
        for key in ("forced", "quant_fused", "notes", "profile"):
            d[key] = tuple(d.get(key, ()))
        return cls(**d)

    def key(self) -> str:
        """Stable hash of every decision (notes excluded): names compiled kernels."""
        d = self.to_dict()
        d.pop("notes")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def __str__(self) -> str:
        s = self.shape
        rows = [
            ("shape", f"{s.name or 'custom'}: E={s.num_experts} D={s.hidden} I={s.intermediate} "
                      f"k={s.topk} shared={s.shared_experts}x{s.shared_dim}"),
            ("ep / local experts", f"{self.ep} / {self.local_experts}"),
            ("tokens per rank", self.tokens_per_rank),
            ("dtype", f"{self.dtype} (routed GEMMs {self.act_dtype}, shared {self.shared_dtype})"),
            ("target", f"{self.gpu} {self.arch}, {self.num_sms} CTAs per launch"
                       + (f" ({self.reserve_sms} SMs left to collectives)"
                          if self.reserve_sms else "")),
            ("forward comm", f"dispatch={self.dispatch} combine={self.combine}"),
            ("backward comm", f"reverse_combine={self.reverse_combine} "
                              f"reverse_dispatch={self.reverse_dispatch}"),
            ("comm SMs fwd / bwd", f"{self.comm_sms_fwd} / {self.comm_sms_bwd}"),
            ("minibatch (rows)", f"{self.minibatch} (tile {self.block_m})"),
            ("macrobatch (ring rows)", f"{self.macrobatch} = {self.ring_slots} slots, "
                                       f"{(self.ring_bytes or 0) / 2**20:.1f} MiB, "
                                       "walked in reverse (macrobatch 0 stays resident)"),
            ("routed rows exp / max", f"{self.expected_routed_rows} / {self.max_routed_rows}"),
            ("expected replay rows", self.expected_replay_rows),
            ("fused quantization", ", ".join(self.quant_fused) or "none"),
            ("forced", ", ".join(self.forced) or "none"),
            *([("PROFILING BUILD", ", ".join(self.profile) + ": results are wrong")]
              if self.profile else []),
            ("backward", f"no: {why}" if (why := backward_unsupported(self)) else "yes"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        if self.signals:
            lines.append("signals per minibatch (op, dir, local, cross-GPU):")
            lines += [f"  {op:<16} {d:<4} {loc:>4} {cross:>4}" for op, d, loc, cross in self.signals]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def initial_plan(shape: MoEShape, ep: int, dtype: str, tokens_per_rank: int,
                 **overrides) -> Plan:
    """Validate the problem and the overrides; no decisions yet."""
    if not isinstance(shape, MoEShape):
        raise TypeError(f"shape must be a mokgen.MoEShape, got {type(shape).__name__}")
    shape.local_experts(ep)  # validates ep
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if isinstance(tokens_per_rank, bool) or not isinstance(tokens_per_rank, int) \
            or tokens_per_rank <= 0:
        raise ValueError(f"tokens_per_rank must be a positive int, got {tokens_per_rank!r}")
    unknown = set(overrides) - set(OVERRIDABLE)
    if unknown:
        raise ValueError(f"unknown override(s) {sorted(unknown)}; allowed: {OVERRIDABLE}")
    for op in COMM_OPS:
        if op in overrides and overrides[op] not in DIRECTIONS:
            raise ValueError(f"{op} must be one of {DIRECTIONS}, got {overrides[op]!r}")
    for name in ("comm_sms_fwd", "comm_sms_bwd", "minibatch", "macrobatch", "ring_budget_bytes"):
        if name in overrides:
            v = overrides[name]
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
    gpu = hardware.get(overrides.get("arch", "sm_90a"))
    if "reserve_sms" in overrides:
        v = overrides["reserve_sms"]
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= gpu.num_sms // 2:
            raise ValueError(f"reserve_sms must be an int in [0, {gpu.num_sms // 2}] (at most "
                             f"half of the GPU's {gpu.num_sms} SMs), got {v!r}")
    if "profile" in overrides:
        from .runtime.abi import PROFILES

        v = overrides["profile"]
        if not isinstance(v, (tuple, list)) or not set(v) <= set(PROFILES):
            raise ValueError(f"profile must be a tuple of {tuple(PROFILES)}, got {v!r}")
        overrides["profile"] = tuple(sorted(set(v)))
    if "overlap_comm" in overrides and not isinstance(overrides["overlap_comm"], bool):
        raise ValueError(f"overlap_comm must be True or False, got {overrides['overlap_comm']!r}")
    usable = gpu.num_sms - overrides.get("reserve_sms", 0)
    for name in ("comm_sms_fwd", "comm_sms_bwd"):
        if name in overrides and overrides[name] >= usable:
            raise ValueError(f"{name} must be < {usable} (the GPU's {gpu.num_sms} SMs less "
                             f"reserve_sms), got {overrides[name]}")
    if "minibatch" in overrides and overrides["minibatch"] % BLOCK_M:
        raise ValueError(f"minibatch must be a multiple of the GEMM tile {BLOCK_M}, "
                         f"got {overrides['minibatch']}")
    if "macrobatch" in overrides:
        mb = overrides.get("minibatch", BLOCK_M)
        if overrides["macrobatch"] % mb or overrides["macrobatch"] < 2 * mb:
            raise ValueError(f"macrobatch must be a multiple of the minibatch ({mb}) holding "
                             f"at least two minibatches, got {overrides['macrobatch']}")
    fields = dict(overrides)
    fields["arch"] = gpu.arch
    return Plan(shape=shape, ep=ep, dtype=dtype, tokens_per_rank=tokens_per_rank,
                gpu=gpu.name, forced=tuple(sorted(overrides)), **fields)
