"""Typed nodes of the task graph: buffers (data) and ops (tasks).

Both are frozen and hashable so a graph, and anything derived from it, can be part of a
stable plan hash. The builder gives ops what the layer fixes (which ops move data between
ranks, the GEMMs' sizes); the passes add their decisions as further attrs (`with_attrs`), so
an op's communication *direction* (pull/push), precision, tile and SM role appear only once
a pass has decided them.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Union

Dim = Union[int, str]  # int: known at plan time; str: symbolic, known only on the device

# Where a buffer lives. The split matters to codegen: "peer" buffers are allocated through
# symmetric memory so other ranks hold their address; "ring" buffers are logically [P, ...]
# but physically a fixed window of macrobatch rows that wraps (older rows get overwritten).
SPACES = ("local", "peer", "ring")
DIRECTIONS = ("fwd", "bwd")
COMMS = ("dispatch", "combine", "reverse_combine", "reverse_dispatch")


class OpKind(enum.Enum):
    # forward
    ROUTE_TOPK = "route_topk"
    ROUTE_ALLGATHER = "route_allgather"
    SCHEDULE_BUILD = "schedule_build"
    DISPATCH = "dispatch"
    SHARED_FFN = "shared_ffn"
    GATE_UP_GEMM = "gate_up_gemm"
    SWIGLU = "swiglu"
    DOWN_GEMM = "down_gemm"
    COMBINE = "combine"
    WEIGHTED_SUM = "weighted_sum"
    # backward
    REVERSE_COMBINE = "reverse_combine"
    REPLAY = "replay"
    DOWN_DGRAD = "down_dgrad"
    SWIGLU_BWD_ROUTER_GRAD = "swiglu_bwd_router_grad"
    GATE_UP_DGRAD = "gate_up_dgrad"
    REVERSE_DISPATCH = "reverse_dispatch"
    WEIGHT_GRAD_W1 = "weight_grad_w1"
    WEIGHT_GRAD_W2 = "weight_grad_w2"
    SHARED_FFN_BWD = "shared_ffn_bwd"
    ROUTER_BWD = "router_bwd"
    DX_SUM = "dx_sum"

    @property
    def direction(self) -> str:
        return "fwd" if self in FORWARD_KINDS else "bwd"

    @property
    def comm(self) -> str | None:
        return COMM_OF_KIND.get(self)


FORWARD_KINDS = frozenset({
    OpKind.ROUTE_TOPK, OpKind.ROUTE_ALLGATHER, OpKind.SCHEDULE_BUILD, OpKind.DISPATCH,
    OpKind.SHARED_FFN, OpKind.GATE_UP_GEMM, OpKind.SWIGLU, OpKind.DOWN_GEMM,
    OpKind.COMBINE, OpKind.WEIGHTED_SUM,
})

# The four token exchanges of the layer. ROUTE_ALLGATHER also writes to peers, but it is a
# tiny unicast all-gather run before the megakernel, not a token exchange the SM split and
# minibatch pipeline have to be planned around, so it is deliberately not a comm op here.
COMM_OF_KIND = {
    OpKind.DISPATCH: "dispatch",
    OpKind.COMBINE: "combine",
    OpKind.REVERSE_COMBINE: "reverse_combine",
    OpKind.REVERSE_DISPATCH: "reverse_dispatch",
}


class GemmConfig(NamedTuple):
    """A GEMM operator's tile (runtime/include/mokgen/gemm_types.cuh GemmCfg): `bm` x `bn`
    outputs per CTA tile, `stages` K-slices in flight in shared memory; the two consumer
    warpgroups run each tile together, 64 rows each, then its epilogue. `pair` (the
    forward's, bf16): the kernel runs in 2-CTA clusters whose CTAs take tasks two at a time,
    and vertically adjacent tiles under the same weight rows (gate/up, down) load half of
    their weight slices each, multicast to both (gemm_tile.cuh produce_pairs): an option,
    off by default."""

    bm: int
    bn: int
    stages: int
    pair: bool = False

    def __str__(self) -> str:
        pa = ", multicast pairs" if self.pair else ""
        return f"{self.bm}x{self.bn}, {self.stages} stages{pa}"

    def fields(self) -> list:
        """As JSON: (bm, bn, stages), + pair where it is set, so plans of the default
        schedule keep their keys (and their kernels' names) from before the field existed."""
        return list(self[:4] if self.pair else self[:3])


@dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple[Dim, ...]
    dtype: str
    space: str = "local"

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"Buffer name must be a non-empty str, got {self.name!r}")
        object.__setattr__(self, "shape", tuple(self.shape))
        for d in self.shape:
            ok_int = isinstance(d, int) and not isinstance(d, bool) and d > 0
            if not (ok_int or (isinstance(d, str) and d)):
                raise ValueError(f"Buffer {self.name}: dims must be positive ints or "
                                 f"symbolic names, got {d!r} in {self.shape}")
        if not self.dtype or not isinstance(self.dtype, str):
            raise ValueError(f"Buffer {self.name}: dtype must be a non-empty str")
        if self.space not in SPACES:
            raise ValueError(f"Buffer {self.name}: space must be one of {SPACES}, "
                             f"got {self.space!r}")

    @property
    def symbolic(self) -> tuple[str, ...]:
        """Dims only the device knows (their extent is data-dependent routing)."""
        return tuple(d for d in self.shape if isinstance(d, str))

    def __str__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"{self.name}[{dims}] {self.dtype} {self.space}"


@dataclass(frozen=True)
class Op:
    """One task. `attrs` is a sorted tuple of (key, value) pairs so the op stays hashable;
    pass a dict and it is normalized."""

    name: str
    kind: OpKind
    direction: str
    comm: str | None = None
    attrs: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"Op name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.kind, OpKind):
            raise TypeError(f"Op {self.name}: kind must be an OpKind, got {self.kind!r}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"Op {self.name}: direction must be one of {DIRECTIONS}, "
                             f"got {self.direction!r}")
        # The kind fixes both; catching a mismatch here keeps passes from having to.
        if self.direction != self.kind.direction:
            raise ValueError(f"Op {self.name}: {self.kind.name} is a {self.kind.direction} "
                             f"op, got direction={self.direction!r}")
        if self.comm != self.kind.comm:
            raise ValueError(f"Op {self.name}: {self.kind.name} has comm={self.kind.comm!r}, "
                             f"got {self.comm!r}")
        attrs = self.attrs.items() if isinstance(self.attrs, Mapping) else self.attrs
        attrs = tuple(sorted((str(k), v) for k, v in attrs))
        hash(attrs)  # unhashable values would break the frozen dataclass's hash later
        object.__setattr__(self, "attrs", attrs)

    def attr(self, key: str, default: Any = None) -> Any:
        return dict(self.attrs).get(key, default)

    def with_attrs(self, **attrs) -> "Op":
        """This op with `attrs` added (or replaced): how a pass records a decision."""
        return dataclasses.replace(self, attrs={**dict(self.attrs), **attrs})

    def __str__(self) -> str:
        tag = f" comm={self.comm}" if self.comm else ""
        return f"{self.name} ({self.kind.value}, {self.direction}{tag})"
