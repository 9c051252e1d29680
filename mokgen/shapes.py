"""MoE layer shapes: the problem description every other stage starts from."""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

ACTIVATIONS = ("swiglu",)
SCORES = ("softmax",)


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer: E routed experts of width I, k routes per token, hidden size D.

    Weights follow nn.Linear: w1 [L, 2I, D] (gate rows then up rows), w2 [L, D, I].
    `shared_experts` is 0 or 1: a model's n shared experts of width s are one of width n * s
    (`shared_intermediate`), since their outputs are summed.
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
        # Rows are moved as 16-byte vectors (8 bf16); the kernels' own rules are limits.py's.
        for field in ("hidden", "intermediate"):
            if getattr(self, field) % 8:
                raise ValueError(f"{field} must be a multiple of 8, got {getattr(self, field)}")
        if self.shared_experts and self.shared_dim % 8:
            raise ValueError(f"shared_intermediate must be a multiple of 8, got {self.shared_dim}")

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


def _hf(name: str, e: int, d: int, i: int, k: int, shared: int = 0) -> MoEShape:
    """A public model's MoE layer from its config.json: routed experts, hidden_size, the
    routed expert's intermediate size, experts per token, and the shared experts' total
    intermediate size (0: none). n shared experts of width s are one of width n * s: their
    outputs are summed, so the concatenated weights compute the same function."""
    return MoEShape(e, d, i, k, shared_experts=int(shared > 0),
                    shared_intermediate=shared or None, name=name)


_PRESETS = {
    "kimi-k2.7": MoEShape(384, 7168, 2048, 8, name="kimi-k2.7"),
    "glm-5.2": MoEShape(256, 6144, 2048, 8, name="glm-5.2"),
    "qwen3.5-397b-a17b": MoEShape(512, 4096, 1024, 10, name="qwen3.5-397b-a17b"),
    "deepseek-v4-pro": MoEShape(384, 7168, 3072, 6, name="deepseek-v4-pro"),
    # Public models, from huggingface.co/<repo>/blob/main/config.json (repo in the comment).
    # These are layer shapes: mokgen's own router is softmax top-k renormalized (docs/design.md);
    # a model that routes otherwise (sigmoid scores, unnormalized or scaled weights) passes
    # its routes to the layer (`routes=`), as mokgen.patch does for transformers models.
    # Qwen/Qwen3-30B-A3B: num_experts, hidden_size, moe_intermediate_size, num_experts_per_tok
    "qwen3-30b-a3b": _hf("qwen3-30b-a3b", 128, 2048, 768, 8),
    # Qwen/Qwen3-235B-A22B
    "qwen3-235b-a22b": _hf("qwen3-235b-a22b", 128, 4096, 1536, 8),
    # Qwen/Qwen3-Next-80B-A3B-Instruct: + shared_expert_intermediate_size 512
    "qwen3-next-80b-a3b": _hf("qwen3-next-80b-a3b", 512, 2048, 512, 10, shared=512),
    # Qwen/Qwen1.5-MoE-A2.7B: shared_expert_intermediate_size 5632 (norm_topk_prob false)
    "qwen1.5-moe-a2.7b": _hf("qwen1.5-moe-a2.7b", 60, 2048, 1408, 4, shared=5632),
    # deepseek-ai/DeepSeek-V2-Lite: n_routed_experts, moe_intermediate_size, n_shared_experts 2
    "deepseek-v2-lite": _hf("deepseek-v2-lite", 64, 2048, 1408, 6, shared=2 * 1408),
    # deepseek-ai/DeepSeek-V2: n_shared_experts 2 (group-limited routing)
    "deepseek-v2": _hf("deepseek-v2", 160, 5120, 1536, 6, shared=2 * 1536),
    # deepseek-ai/DeepSeek-V3: n_shared_experts 1 (sigmoid, group-limited routing)
    "deepseek-v3": _hf("deepseek-v3", 256, 7168, 2048, 8, shared=2048),
    # zai-org/GLM-4.5-Air: n_routed_experts, moe_intermediate_size, n_shared_experts 1 (sigmoid)
    "glm-4.5-air": _hf("glm-4.5-air", 128, 4096, 1408, 8, shared=1408),
    # mistralai/Mixtral-8x7B-v0.1: num_local_experts, intermediate_size
    "mixtral-8x7b": _hf("mixtral-8x7b", 8, 4096, 14336, 2),
    # mistralai/Mixtral-8x22B-v0.1
    "mixtral-8x22b": _hf("mixtral-8x22b", 8, 6144, 16384, 2),
    # allenai/OLMoE-1B-7B-0924: num_experts, intermediate_size (norm_topk_prob false)
    "olmoe-1b-7b": _hf("olmoe-1b-7b", 64, 2048, 1024, 8),
    # openai/gpt-oss-20b: num_local_experts, intermediate_size, num_experts_per_tok. Shape only:
    # its experts are a clamped SwiGLU with biases, not mokgen's SwiGLU.
    "gpt-oss-20b": _hf("gpt-oss-20b", 32, 2880, 2880, 4),
    # openai/gpt-oss-120b: shape only, as gpt-oss-20b
    "gpt-oss-120b": _hf("gpt-oss-120b", 128, 2880, 2880, 4),
    # meta-llama/Llama-4-Scout-17B-16E (text_config): num_local_experts, intermediate_size,
    # one shared expert of intermediate_size (sigmoid router weight)
    "llama-4-scout": _hf("llama-4-scout", 16, 5120, 8192, 1, shared=8192),
    # meta-llama/Llama-4-Maverick-17B-128E (text_config); every other layer is MoE
    "llama-4-maverick": _hf("llama-4-maverick", 128, 5120, 8192, 1, shared=8192),
    # ibm-granite/granite-3.0-3b-a800m-base: num_local_experts, intermediate_size
    "granite-3.0-3b-a800m": _hf("granite-3.0-3b-a800m", 40, 1536, 512, 8),
    # microsoft/Phi-3.5-MoE-instruct: num_local_experts, intermediate_size (sparsemixer router)
    "phi-3.5-moe": _hf("phi-3.5-moe", 16, 4096, 6400, 2),
    # databricks/dbrx-base: ffn_config moe_num_experts, ffn_hidden_size, moe_top_k; d_model
    "dbrx": _hf("dbrx", 16, 6144, 10752, 4),
    # Small shapes for tests: same structure, CPU-sized, and within the kernels' widths
    # (mokgen.compiler.limits) so the same plans serve the interpreter and nvcc.
    "tiny": MoEShape(8, 256, 128, 2, name="tiny"),
    "small": MoEShape(16, 256, 256, 4, name="small"),
    "small-noshared": MoEShape(16, 256, 256, 4, shared_experts=0, name="small-noshared"),
    "gpu-small": MoEShape(32, 1024, 512, 4, name="gpu-small"),
}

PRESETS_MAIN = ("kimi-k2.7", "glm-5.2", "qwen3.5-397b-a17b", "deepseek-v4-pro")
# The public models above, in the order of the table.
PRESETS_MODELS = tuple(n for n in _PRESETS if n not in PRESETS_MAIN
                       and n not in ("tiny", "small", "small-noshared", "gpu-small"))


def names() -> list[str]:
    return list(_PRESETS)


def get(name: str) -> MoEShape:
    """The preset called `name`, in any case ("Qwen3-30B-A3B" as on Hugging Face)."""
    if not isinstance(name, str):
        raise TypeError(f"a shape preset's name is a str, got {type(name).__name__}")
    key = name.strip().lower()
    if key not in _PRESETS:
        close = difflib.get_close_matches(key, _PRESETS, n=3)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        raise ValueError(f"unknown shape preset {name!r}{hint}; known: {', '.join(_PRESETS)}")
    return _PRESETS[key]
