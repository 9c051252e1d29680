"""MoE layer shapes: the problem description every other stage starts from."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ACTIVATIONS = ("swiglu",)
SCORES = ("softmax",)


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer: E routed experts of width I, k routes per token, hidden size D.

    Weights follow nn.Linear: w1 [L, 2I, D] (gate rows then up rows), w2 [L, D, I].
    """

    num_experts: int
    hidden: int
    intermediate: int
    topk: int
    shared_experts: int = 1
    shared_intermediate: int | None = None
    activation: str = "swiglu"
    score: str = "softmax"
    name: str = ""

    def __post_init__(self):
        for field in ("num_experts", "hidden", "intermediate", "topk"):
            _check_positive_int(field, getattr(self, field))
        if not isinstance(self.shared_experts, int) or self.shared_experts not in (0, 1):
            raise ValueError(f"shared_experts must be 0 or 1, got {self.shared_experts!r}")
        if self.shared_intermediate is not None:
            _check_positive_int("shared_intermediate", self.shared_intermediate)
        if self.topk > self.num_experts:
            raise ValueError(
                f"topk must be <= num_experts ({self.num_experts}), got {self.topk}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
        # Rows are moved as 16-byte vectors and tensor-core K steps are 16 wide.
        for field in ("hidden", "intermediate"):
            if getattr(self, field) % 16:
                raise ValueError(f"{field} must be a multiple of 16, got {getattr(self, field)}")
        if self.shared_experts and self.shared_dim % 16:
            raise ValueError(f"shared_intermediate must be a multiple of 16, got {self.shared_dim}")

    @property
    def shared_dim(self) -> int:
        """Intermediate width of the shared expert (0 when there is none)."""
        if not self.shared_experts:
            return 0
        return self.shared_intermediate or self.intermediate

    def local_experts(self, ep: int) -> int:
        _check_positive_int("ep", ep)
        if self.num_experts % ep:
            raise ValueError(
                f"ep must divide num_experts ({self.num_experts}), got ep={ep}")
        return self.num_experts // ep

    def forward_flops(self, tokens: int) -> int:
        """Paper's effective FLOP count of one forward: 6 N (k+1) D I."""
        return 6 * tokens * (self.topk + self.shared_experts) * self.hidden * self.intermediate

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MoEShape":
        return cls(**d)


def _check_positive_int(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{field} must be a positive int, got {value!r}")


_PRESETS = {
    "kimi-k2.7": MoEShape(384, 7168, 2048, 8, name="kimi-k2.7"),
    "glm-5.2": MoEShape(256, 6144, 2048, 8, name="glm-5.2"),
    "qwen3.5-397b-a17b": MoEShape(512, 4096, 1024, 10, name="qwen3.5-397b-a17b"),
    "deepseek-v4-pro": MoEShape(384, 7168, 3072, 6, name="deepseek-v4-pro"),
    # Small shapes for tests: same structure, CPU-sized, and within the kernels' widths
    # (mokgen.limits) so the same plans serve the interpreter and nvcc.
    "tiny": MoEShape(8, 256, 128, 2, name="tiny"),
    "small": MoEShape(16, 256, 256, 4, name="small"),
    "small-noshared": MoEShape(16, 256, 256, 4, shared_experts=0, name="small-noshared"),
    "gpu-small": MoEShape(32, 1024, 512, 4, name="gpu-small"),
}

PRESETS_MAIN = ("kimi-k2.7", "glm-5.2", "qwen3.5-397b-a17b", "deepseek-v4-pro")


def names() -> list[str]:
    return list(_PRESETS)


def get(name: str) -> MoEShape:
    if name not in _PRESETS:
        raise ValueError(f"unknown shape preset {name!r}; known: {', '.join(_PRESETS)}")
    return _PRESETS[name]
