"""The Plan: every decision the compiler made about one MoE layer, as a frozen view of the
annotated task graph.

`initial_graph()` validates the problem and the overrides and builds the layer's task graph
(mokgen.compiler.ir); each pass of `mokgen.compiler.passes.PASSES` annotates its operators (graph in, new graph
out); `Plan.of(graph)` reads the decisions back as flat fields and keeps the graph
(`plan.graph`), which codegen lowers operator by operator (mokgen/compiler/lower.py). A field set
through `overrides` is recorded in `forced`; its pass writes the forced value instead of
choosing one (ablations, tuning). A Plan read from JSON or changed by `replace` has no graph:
`annotated(plan)` re-runs the passes with the plan's decisions forced.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from mokgen.compiler import hardware, ir
from mokgen.compiler.ir import GemmConfig, OpKind
from mokgen.compiler.limits import DEFAULT_GEMM, DIRECTIONS, backward_unsupported, directions
from mokgen.shapes import MoEShape

DTYPES = ("bf16", "fp8", "mxfp8")
COMM_OPS = tuple(DIRECTIONS)  # dispatch, combine, reverse_combine, reverse_dispatch

# Fields a caller may force: together they reproduce every decision (`Plan.decisions`).
OVERRIDABLE = COMM_OPS + ("comm_sms_fwd", "comm_sms_bwd", "minibatch", "macrobatch",
                          "ring_budget_bytes", "x_slots", "keep_h", "arch", "gpu",
                          "reserve_sms", "overlap_comm", "profile", "gemm_fwd", "gemm_bwd")
# The target, not a decision: named or not, a plan for a GPU is the same plan (and key), so
# kernels built ahead for a kind are the ones its devices find (never in `forced`).
TARGET = ("arch", "gpu")


@dataclass(frozen=True)
class Plan:
    shape: MoEShape
    ep: int
    dtype: str
    tokens_per_rank: int
    arch: str = "sm_90a"
    # the GPU it is planned for (hardware.target): its kind (the cost models' rates), SM count
    # and shared memory a block; the runtime refuses a device whose SMs or shared memory
    # differ (runtime/checks.py check_gpu)
    gpu: str = hardware.CPU_DEFAULT
    gpu_sms: int = hardware.get(hardware.CPU_DEFAULT).num_sms
    gpu_smem: int = hardware.get(hardware.CPU_DEFAULT).smem_per_block
    forced: tuple = ()
    # comm_direction: the comm ops' directions (limits.directions)
    dispatch: str | None = None
    combine: str | None = None
    reverse_combine: str | None = None
    reverse_dispatch: str | None = None
    # precision: what the GEMM ops read
    act_dtype: str | None = None     # what the routed GEMMs read
    shared_dtype: str | None = None  # the shared expert stays bf16
    quant_fused: tuple = ()          # where activation quantization happens
    scale_block: int = 0             # elements per scale along K: 0 (bf16), 128 (fp8), 32 (mx)
    row_bytes: int | None = None     # bytes of one dispatched token row (data + scales)
    # sm_partition: the ops' SM roles
    profile: tuple = ()          # profiling builds (runtime/abi.py PROFILES)
    overlap_comm: bool = False   # the user runs collectives (FSDP gathers) beside the layer
    reserve_sms: int = 0         # SMs left free for them: no CTA of the megakernels runs there
    num_sms: int | None = None   # CTAs of each persistent launch: the GPU's SMs - reserve_sms
    comm_sms_fwd: int | None = None
    comm_sms_bwd: int | None = None
    # tiling: the GEMM ops' tile, one per kernel
    gemm_fwd: GemmConfig | None = None
    gemm_bwd: GemmConfig | None = None
    # granularity
    minibatch: int | None = None
    # ring
    ring_budget_bytes: int = 4 << 30
    macrobatch: int | None = None
    ring_bytes: int | None = None
    max_routed_rows: int | None = None     # worst case rows one rank can receive (padded)
    expected_routed_rows: int | None = None
    expected_replay_rows: int | None = None
    # x_window: the backward's x ring in minibatch slots (None: the ring's own)
    x_slots: int | None = None
    # keep_h: each differentiable call keeps its own gate/up pre-activations (h) for its
    # backward, so that no backward replays gate/up, whatever other layers ran between
    # (the default where limits.keep_h_violations allow it)
    keep_h: bool = False
    # the annotated task graph this plan views (None: read from JSON or `replace`d)
    graph: Any = field(default=None, compare=False, repr=False)

    # ------------------------------------------------------------------ derived
    @property
    def local_experts(self) -> int:
        return self.shape.local_experts(self.ep)

    @property
    def ring_slots(self) -> int:
        return self.macrobatch // self.minibatch

    @property
    def block_m(self) -> int | None:
        """GEMM tile rows, the unit expert regions of the ring are padded to."""
        return self.gemm_fwd.bm if self.gemm_fwd else None

    def replace(self, **changes) -> "Plan":
        """A changed copy; it no longer views a graph (see `annotated`)."""
        return dataclasses.replace(self, graph=None, **changes)

    @property
    def target(self) -> hardware.GPU:
        """The GPU the passes planned for (hardware.for_plan: its kind at its SMs)."""
        return hardware.for_plan(self.gpu, self.gpu_sms, self.gpu_smem)

    def is_forced(self, name: str) -> bool:
        return name in self.forced

    def decisions(self) -> dict:
        """The overridable fields that are set: forced, they make this plan again (the GPU
        as `gpu=`, the target itself)."""
        d = {k: getattr(self, k) for k in OVERRIDABLE if k not in TARGET
             and getattr(self, k) is not None}
        return dict(d, gpu=self.target)

    # ------------------------------------------------------------------ the view
    @classmethod
    def of(cls, g) -> "Plan":
        """The decisions annotated on task graph `g` so far (forced values where a pass has
        not run yet, None where nothing is decided)."""
        pb, ops = g.graph["problem"], ir.ops(g)
        f = dict(pb["overrides"], shape=pb["shape"], ep=pb["ep"], dtype=pb["dtype"],
                 tokens_per_rank=pb["tokens_per_rank"], arch=pb["arch"], gpu=pb["gpu"],
                 gpu_sms=pb["gpu_sms"], gpu_smem=pb["gpu_smem"], forced=pb["forced"])

        def put(name, value):
            if value is not None:
                f[name] = value

        comm = {o.comm: o for o in ir.comm_ops(g)}
        for name, o in comm.items():
            put(name, o.attr("comm_direction"))
        gate, shared = ir.op_of(g, OpKind.GATE_UP_GEMM), ir.op_of(g, OpKind.SHARED_FFN)
        put("act_dtype", gate.attr("precision"))
        put("keep_h", gate.attr("keep_h"))
        put("shared_dtype", shared and shared.attr("precision"))
        put("scale_block", ir.common(ops, "scale_block"))
        put("row_bytes", comm["dispatch"].attr("row_bytes"))
        f["quant_fused"] = tuple(dict.fromkeys(o.attr("quantize") for o in ops
                                               if o.attr("quantize")))
        launch = {}  # direction -> CTAs of its persistent launch
        for d in ("fwd", "bwd"):
            dops = [o for o in ops if o.direction == d]
            c = ir.common([o for o in dops if o.attr("sm_role") == "comm"], "ctas")
            compute = ir.common([o for o in dops if o.attr("sm_role") == "compute"], "ctas")
            put(f"comm_sms_{d}", c)
            if c is not None and compute is not None:
                launch[d] = c + compute
            put(f"gemm_{d}", ir.common(ir.gemm_ops(g, d), "gemm"))
        if len(set(launch.values())) > 1:
            raise ValueError(f"the forward launches {launch['fwd']} CTAs and the backward "
                             f"{launch['bwd']}: a plan has one num_sms")
        if launch:
            f["num_sms"] = launch["fwd"]
            if "reserve_sms" not in pb["forced"]:
                f["reserve_sms"] = pb["gpu_sms"] - f["num_sms"]
        ring = ir.ring_ops(g)
        put("minibatch", ir.common(ring, "minibatch"))
        put("macrobatch", ir.common(ring, "ring_rows"))
        put("x_slots", comm["reverse_combine"].attr("x_slots"))
        f.update(g.graph.get("ring", {}))
        return cls(**f, graph=g)

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "graph"}
        d["shape"] = self.shape.to_dict()
        for key in ("forced", "quant_fused", "profile"):
            d[key] = None if d[key] is None else list(d[key])
        for key in ("gemm_fwd", "gemm_bwd"):
            d[key] = None if d[key] is None else d[key].fields()
        if not d["keep_h"]:  # a later field: the plans without it keep their keys
            del d["keep_h"]
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        d["shape"] = MoEShape.from_dict(d["shape"])
        kind = hardware.get(d.get("gpu", hardware.CPU_DEFAULT))  # plans before gpu_sms
        d.setdefault("gpu_sms", kind.num_sms)
        d.setdefault("gpu_smem", kind.smem_per_block)
        d.pop("signals", None)  # plans written before the directions were fixed
        for key in ("forced", "quant_fused", "profile"):
            d[key] = tuple(d.get(key, ()))
        for key in ("gemm_fwd", "gemm_bwd"):
            d[key] = d.get(key) and GemmConfig(*d[key])
        return cls(**d)

    def key(self) -> str:
        """Stable hash of every decision: names compiled kernels."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def __str__(self) -> str:
        s = self.shape
        rows = [
            ("shape", f"{s.name or 'custom'}: E={s.num_experts} D={s.hidden} I={s.intermediate} "
                      f"k={s.topk} shared={s.shared_experts}x{s.shared_dim}"),
            ("ep / local experts", f"{self.ep} / {self.local_experts}"),
            ("tokens per rank", self.tokens_per_rank),
            ("dtype", f"{self.dtype} (routed GEMMs {self.act_dtype}, shared {self.shared_dtype})"),
            ("target", f"{self.gpu} {self.arch} ({self.gpu_sms} SMs, "
                       f"{self.gpu_smem // 1024} KiB shared memory a block), "
                       f"{self.num_sms} CTAs per launch"
                       + (f" ({self.reserve_sms} SMs left to collectives)"
                          if self.reserve_sms else "")),
            ("forward comm", f"dispatch={self.dispatch} combine={self.combine}"),
            ("backward comm", f"reverse_combine={self.reverse_combine} "
                              f"reverse_dispatch={self.reverse_dispatch}"),
            ("comm SMs fwd / bwd", f"{self.comm_sms_fwd} / {self.comm_sms_bwd}"),
            ("GEMM tiles fwd / bwd", f"{self.gemm_fwd} / {self.gemm_bwd}"),
            ("minibatch (rows)", f"{self.minibatch} (tile {self.block_m})"),
            ("macrobatch (ring rows)", f"{self.macrobatch} = {self.ring_slots} slots, "
                                       f"{(self.ring_bytes or 0) / 2**20:.1f} MiB, "
                                       "walked in reverse (macrobatch 0 stays resident)"),
            ("routed rows exp / max", f"{self.expected_routed_rows} / {self.max_routed_rows}"),
            *([("backward x ring", f"{self.x_slots} slots (a window: passes/x_window.py)")]
              if self.x_slots is not None else []),
            ("expected replay rows", "0 (each call keeps its h: keep_h)" if self.keep_h
             else self.expected_replay_rows),
            ("fused quantization", ", ".join(self.quant_fused) or "none"),
            ("forced", ", ".join(self.forced) or "none"),
            *([("PROFILING BUILD", ", ".join(self.profile) + (
                ": per-task timestamps, results right" if set(self.profile) == {"trace"}
                else ": results are wrong"))] if self.profile else []),
            ("backward", f"no: {why}" if (why := backward_unsupported(self)) else "yes"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def initial_plan(shape: MoEShape, ep: int, dtype: str, tokens_per_rank: int,
                 **overrides) -> Plan:
    """The problem before any pass: the view of `initial_graph`."""
    return Plan.of(initial_graph(shape, ep, dtype, tokens_per_rank, **overrides))


def initial_graph(shape: MoEShape, ep: int, dtype: str, tokens_per_rank: int, **overrides):
    """Validate the problem and the overrides; the layer's task graph (both directions) with
    them as its `problem` attr, no decisions yet."""
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
        ok = directions(op)
        if op in overrides and overrides[op] not in ok:
            raise ValueError(f"{op} must be one of {ok}, got {overrides[op]!r}")
    for name in ("comm_sms_fwd", "comm_sms_bwd", "minibatch", "macrobatch", "ring_budget_bytes",
                 "x_slots"):
        if name in overrides:
            v = overrides[name]
            low = 0 if name.startswith("comm_sms") else 1  # 0: gathered rows (limits.GATHER)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    gpu = hardware.target(overrides.pop("gpu", None), overrides.pop("arch", None))
    if "reserve_sms" in overrides:
        v = overrides["reserve_sms"]
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= gpu.num_sms // 2:
            raise ValueError(f"reserve_sms must be an int in [0, {gpu.num_sms // 2}] (at most "
                             f"half of the GPU's {gpu.num_sms} SMs), got {v!r}")
    if "profile" in overrides:
        from mokgen.runtime.abi import PROFILES

        v = overrides["profile"]
        if not isinstance(v, (tuple, list)) or not set(v) <= set(PROFILES):
            raise ValueError(f"profile must be a tuple of {tuple(PROFILES)}, got {v!r}")
        overrides["profile"] = tuple(sorted(set(v)))
    for name in ("gemm_fwd", "gemm_bwd"):
        if name in overrides:
            v = overrides[name]
            if not isinstance(v, (tuple, list)) or len(v) not in (3, 4) or not all(
                    isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v[:3]) \
                    or not all(isinstance(x, bool) for x in v[3:]):
                raise ValueError(f"{name} must be (bm, bn, stages[, pair]): three positive "
                                 f"ints and an optional bool, got {v!r}")
            overrides[name] = GemmConfig(*v)
    for name in ("overlap_comm", "keep_h"):
        if name in overrides and not isinstance(overrides[name], bool):
            raise ValueError(f"{name} must be True or False, got {overrides[name]!r}")
    usable = gpu.num_sms - overrides.get("reserve_sms", 0)
    for name in ("comm_sms_fwd", "comm_sms_bwd"):
        if name in overrides and overrides[name] >= usable:
            raise ValueError(f"{name} must be < {usable} (the GPU's {gpu.num_sms} SMs less "
                             f"reserve_sms), got {overrides[name]}")
    tile = overrides.get("gemm_fwd", DEFAULT_GEMM).bm
    if "minibatch" in overrides and overrides["minibatch"] % tile:
        raise ValueError(f"minibatch must be a multiple of the GEMM tile {tile}, "
                         f"got {overrides['minibatch']}")
    if "macrobatch" in overrides:
        mb = overrides.get("minibatch", tile)
        if overrides["macrobatch"] % mb or overrides["macrobatch"] < 2 * mb:
            raise ValueError(f"macrobatch must be a multiple of the minibatch ({mb}) holding "
                             f"at least two minibatches, got {overrides['macrobatch']}")
    g = ir.build_graph(shape, ep, tokens_per_rank)
    g.graph["problem"] = dict(shape=shape, ep=ep, dtype=dtype, tokens_per_rank=tokens_per_rank,
                              arch=gpu.arch, gpu=gpu.name, gpu_sms=gpu.num_sms,
                              gpu_smem=gpu.smem_per_block, forced=tuple(sorted(overrides)),
                              overrides=overrides)
    return g
