"""mokgen as the MoE of torchtitan models (torchtitan >= 0.3).

The one way in is a torchtitan override, activated like any other:

    --override.imports mokgen.integrations.torchtitan.mokgen_moe

(or `config.override.imports = ["mokgen.integrations.torchtitan.mokgen_moe"]` in Python; a
`("...mokgen_moe", {"tokens_per_rank": 32768})` entry passes options). torchtitan applies it
to the model config before anything is built, so every `MoE.Config` becomes a
`MokgenMoE.Config` and the model is built, initialized, sharded, checkpointed and compiled by
torchtitan as before. docs/torchtitan.md is the guide.

What changes and what does not:
- torchtitan's router runs as it is (softmax or sigmoid scores, node-limited groups, the
  load-balancing bias, route_norm and route_scale); its top-k scores and expert ids go to
  mokgen's `moe_forward_routed`, which runs dispatch, the routed experts, the shared expert
  and the combine in one call. The token counts torchtitan's load-balancing hook reads
  (`tokens_per_expert_E`) are kept as before.
- gate and up weights are stored once, fused in mokgen's layout (`w13`: [E, 2F, D], gate rows
  then up rows; the shared expert's [2F_s, D]); state-dict hooks save and load them as
  torchtitan's `w1_EFD` / `w3_EFD` (shared expert: `w1.weight` / `w3.weight`), so checkpoints
  of either model load in the other unchanged.
- a shared expert the kernels do not compute (Qwen3.5's sigmoid-gated one, or one with
  biases) stays torchtitan's own module, run beside mokgen's call and added to its output,
  as torchtitan's MoE adds it; the routed experts still go through mokgen.
- the module paths torchtitan's FSDP code names (`moe.routed_experts.inner_experts`, whose
  parameters get the experts' shard placement) and its bias-update hook reads (`moe`,
  `tokens_per_expert_E`, `expert_bias_E`, `load_balance_coeff`) stay.

Refused with a ValueError at conversion or at parallelization: gpt-oss's experts (a clamped
SwiGLU with biases), tensor parallelism on the experts, expert parallelism > 1.
"""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

try:
    from torchtitan.config.override import derive, override
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.moe import GroupedExperts, MoE
    from torchtitan.protocols.module import Module
    from torchtitan.protocols.sharding import ShardingConfig
except ModuleNotFoundError as e:  # torchtitan is an optional extra; e.name: what is missing
    raise ModuleNotFoundError("mokgen.integrations.torchtitan needs torchtitan >= 0.3 "
                              "(the torchtitan extra: pip install -e '.[torchtitan]'): " + str(e),
                              name=e.name) from e

from mokgen.compiler.planner import plan as make_plan
from mokgen.pytorch import ops
from mokgen.pytorch.module import LayerRegistration
from mokgen.shapes import MoEShape

# torchtitan's names for the gate, up and down weights, as its checkpoints hold them
GATE, UP, DOWN = "w1_EFD", "w3_EFD", "w2_EDF"
# the experts compute in bf16 whatever the master weights' dtype, as torchtitan's own
# grouped GEMMs do (GroupedExperts casts to bf16)
COMPUTE_DTYPE = torch.bfloat16
# the routed experts' precisions the override takes (docs/fp8.md: what each quantizes)
DTYPES = ("bf16", "fp8", "mxfp8")


def _split_init(gate_init, up_init, rows: int):
    """An initializer of a fused [..., 2F, D] weight from torchtitan's per-half ones: each
    half gets its own (up may be depth-scaled unlike gate), on a view of its rows."""
    def init(t: torch.Tensor) -> None:
        with torch.no_grad():  # in place on views of a parameter (nn.init does the same)
            gate_init(t.narrow(-2, 0, rows))
            up_init(t.narrow(-2, rows, rows))
    return init


class MokgenGroupedExperts(GroupedExperts):
    """torchtitan's routed experts with gate and up fused into `w13` [E, 2F, D] (gate rows,
    then up rows: mokgen's w1), `w2_EDF` as before. `w1_EFD` / `w3_EFD` remain readable as
    views, so GroupedExperts.forward (torchtitan's grouped-GEMM path) still works on this
    module; MokgenMoE does not call it."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def __init__(self, config: Config):
        Module.__init__(self)  # not GroupedExperts': it would register w1_EFD / w3_EFD
        E, Fh, D = config.num_experts, config.hidden_dim, config.dim
        self.num_experts, self.hidden_dim = E, Fh
        self.w13 = nn.Parameter(torch.empty(E, 2 * Fh, D))
        self.w2_EDF = nn.Parameter(torch.empty(E, D, Fh))
        self.register_state_dict_post_hook(_save_split("w13", GATE, UP, -2))
        self.register_load_state_dict_pre_hook(_load_joined("w13", GATE, UP, -2))

    @property
    def w1_EFD(self) -> torch.Tensor:
        return self.w13.narrow(-2, 0, self.hidden_dim)

    @property
    def w3_EFD(self) -> torch.Tensor:
        return self.w13.narrow(-2, self.hidden_dim, self.hidden_dim)


class MokgenSharedExpert(FeedForward):
    """torchtitan's shared-expert FeedForward with gate and up fused into `w13` [2F_s, D]
    (mokgen's shared_w1); `w2` stays its Linear. Checkpoints hold `w1.weight` / `w3.weight`
    as before."""

    @dataclass(kw_only=True, slots=True)
    class Config(FeedForward.Config):
        pass

    def __init__(self, config: Config):
        Module.__init__(self)  # not FeedForward's: it would build the w1 / w3 Linears
        Fs, D = config.w1.out_features, config.w1.in_features
        self.hidden_dim = Fs
        self.w13 = nn.Parameter(torch.empty(2 * Fs, D))
        self.w2 = config.w2.build()
        self.register_state_dict_post_hook(_save_split("w13", "w1.weight", "w3.weight", 0))
        self.register_load_state_dict_pre_hook(_load_joined("w13", "w1.weight", "w3.weight", 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.w13).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


def _save_split(fused: str, first: str, second: str, dim: int):
    """State-dict post-hook: the fused weight saved as torchtitan's two halves."""
    def hook(mod, state_dict, prefix, local_metadata):
        w = state_dict.pop(prefix + fused)
        half = w.shape[dim] // 2
        state_dict[prefix + first] = w.narrow(dim, 0, half).contiguous()
        state_dict[prefix + second] = w.narrow(dim, half, half).contiguous()
    return hook


def _load_joined(fused: str, first: str, second: str, dim: int):
    """Load-state-dict pre-hook: torchtitan's two halves joined into the fused weight
    (a state dict that already holds the fused key is left as it is)."""
    def hook(module, state_dict, prefix, *args):
        a, b = prefix + first, prefix + second
        if a in state_dict and b in state_dict:
            state_dict[prefix + fused] = torch.cat([state_dict.pop(a), state_dict.pop(b)], dim)
    return hook


class MokgenMoE(MoE):
    """torchtitan's MoE block with its routed and shared experts run by mokgen. Same router,
    buffers, submodule paths and state-dict keys as MoE."""

    @dataclass(kw_only=True, slots=True)
    class Config(MoE.Config):
        tokens_per_rank: int = 16384
        """Most tokens (local batch x sequence length) one call may take; sizes the plan."""
        dtype: str = "bf16"
        """mokgen's precision for the routed experts: "bf16", "fp8" (blockwise, DeepSeek-style
        scales) or "mxfp8"."""
        backend: str = "kernels"
        """"kernels": the megakernels on CUDA (the PyTorch reference elsewhere);
        "reference": the PyTorch reference on every device (for comparisons)."""

    def __init__(self, config: Config):
        super().__init__(config)
        inner = self.routed_experts.inner_experts
        if not isinstance(inner, MokgenGroupedExperts):
            raise ValueError("MokgenMoE needs MokgenGroupedExperts as its routed experts; "
                             "build it through the mokgen_moe override")
        if _fused_shared(config.shared_experts) != isinstance(self.shared_experts,
                                                              MokgenSharedExpert):
            raise ValueError("MokgenMoE needs MokgenSharedExpert as its shared expert where "
                             "mokgen computes it; build it through the mokgen_moe override")
        self.plan = moe_plan(config, tokens_per_rank=config.tokens_per_rank, dtype=config.dtype)
        self._registration = _shared_registration(self.plan, config.backend)
        # fused gradient accumulation off: torchtitan trains under FSDP2, whose gradients
        # autograd must produce
        self.fuse_grad_accumulation = False

    def parallelize(self, parallel_dims) -> None:
        if parallel_dims.ep > 1:
            raise ValueError(f"mokgen_moe: expert parallelism > 1 is not supported yet (got "
                             f"expert_parallel_degree={parallel_dims.ep}); set it to 1 "
                             "(FSDP shards the experts' weights instead)")
        if parallel_dims.tp > 1:
            raise ValueError(f"mokgen_moe: tensor parallelism on the experts is not supported "
                             f"(got tensor_parallel_degree={parallel_dims.tp})")
        super().parallelize(parallel_dims)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        topk_scores_BLK, topk_ids_BLK, _ = self.router(x_BLD, self.expert_bias_E)
        lead, D = x_BLD.shape[:-1], x_BLD.shape[-1]
        K = topk_ids_BLK.shape[-1]
        ids = topk_ids_BLK.reshape(-1, K)
        n = ids.shape[0]
        if n > self.plan.tokens_per_rank:
            raise ValueError(f"mokgen_moe: a call of {n} tokens, more than the tokens_per_rank="
                             f"{self.plan.tokens_per_rank} this layer was planned for; pass a "
                             "larger one to the override (its kwargs)")
        if self.training:  # what torchtitan's load-balancing hook reads, counted as MoE does
            with torch.no_grad():
                ones = torch.ones(ids.numel(), dtype=self.tokens_per_expert_E.dtype,
                                  device=ids.device)
                self.tokens_per_expert_E.scatter_add_(0, ids.reshape(-1), ones)
        inner = self.routed_experts.inner_experts
        fused = self.shared_experts if isinstance(self.shared_experts,
                                                  MokgenSharedExpert) else None
        cast = lambda t: None if t is None else t.to(COMPUTE_DTYPE)  # noqa: E731
        y = ops.moe_routed(
            cast(x_BLD.reshape(n, D)), ids.long().contiguous(),
            topk_scores_BLK.reshape(n, K).float().contiguous(), cast(inner.w13),
            cast(inner.w2_EDF), cast(fused.w13) if fused is not None else None,
            cast(fused.w2.weight) if fused is not None else None, self._registration.handle)
        y = y.to(x_BLD.dtype).reshape(*lead, D)
        if self.shared_experts is not None and fused is None:  # torchtitan's own, beside
            y = y + self.shared_experts(x_BLD)
        return y

    def expert_params(self) -> tuple:
        """The parameters whose gradients expert_grads returns (mokgen.ops)."""
        inner = self.routed_experts.inner_experts
        return inner.w13, inner.w2_EDF

    def expert_grads(self, w1: torch.Tensor, w2: torch.Tensor):
        """None: gradients reach the experts through autograd (fused accumulation is off)."""
        return None

    def extra_repr(self) -> str:
        s = self.plan.shape
        return (f"mokgen: E={s.num_experts}, D={s.hidden}, I={s.intermediate}, k={s.topk}, "
                f"shared={s.shared_dim}, dtype={self.plan.dtype}, "
                f"tokens_per_rank={self.plan.tokens_per_rank}")


# (plan as JSON, backend) -> the registration every block of that plan shares. torchtitan
# compiles each block on its own with one code object for all of them: one handle (the int
# the custom ops take) for all keeps it a constant of one graph; a handle per block would be
# a new constant per block, a recompile each, and past the first, a symbolic int the ops
# cannot look up. Blocks may share it: the workspace is per plan anyway, a call's state goes
# from forward to backward in its token, no block owns gradients to accumulate into, and the
# fp8 weight cache keeps a set per block (LayerRegistration.share).
_REGISTRATIONS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _shared_registration(plan, backend: str) -> LayerRegistration:
    key = (plan.to_json(indent=None), backend)
    registration = _REGISTRATIONS.get(key)
    if registration is not None:
        return registration.share()
    registration = LayerRegistration(plan, None, backend, owner=None)
    _REGISTRATIONS[key] = registration
    return registration


# ---------------------------------------------------------------- the override
def _refuse_expert_parallel(cfg, what: str) -> None:
    """Expert parallelism shows in the sharding torchtitan wrote into the config before
    overrides run (update_from_config): the experts' weights shard on the "ep" axis. Refused
    here, before anything is built; tensor parallelism, whose placements torchtitan writes
    whatever its degree, is refused in MokgenMoE.parallelize."""
    sc = getattr(cfg, "sharding_config", None)
    for name, layout in ((sc.state_shardings or {}) if sc is not None else {}).items():
        for axis, placement in layout.per_axis_spmd_types().items():
            if getattr(axis, "value", axis) == "ep" and type(placement).__name__ == "Shard":
                raise ValueError(f"mokgen_moe: expert parallelism > 1 is not supported yet "
                                 f"({what}.{name} is sharded over 'ep'); set "
                                 "parallelism.expert_parallel_degree = 1 (FSDP shards the "
                                 "experts' weights instead)")


def _remap_state_sharding(sc, fused: str, first: str, second: str):
    """The sharding config with the two halves' entries replaced by the fused weight's (which
    shards as its first half: on the expert dim for EP, never along the fused rows)."""
    if sc is None:
        return None
    state = dict(sc.state_shardings or {})
    layout = state.pop(first, None)
    state.pop(second, None)
    if layout is not None:
        state[fused] = layout
    return dataclasses.replace(sc, state_shardings=state)


def _refuse_other_type(cfg, expected: type, what: str, only: str) -> None:
    """ValueError unless `cfg` is exactly an `expected` config; gpt-oss's named as such."""
    if type(cfg) is expected:
        return
    if "GptOss" in type(cfg).__qualname__:
        raise ValueError(f"mokgen_moe: gpt-oss's {what} (a clamped SwiGLU with biases) is not "
                         "supported; mokgen implements SwiGLU experts without biases")
    raise ValueError(f"mokgen_moe: {what} of type {type(cfg).__qualname__} is not supported "
                     f"(only {only})")


def _experts_config(cfg: GroupedExperts.Config) -> MokgenGroupedExperts.Config:
    _refuse_other_type(cfg, GroupedExperts.Config, "routed experts",
                       "torchtitan's GroupedExperts: SwiGLU, no biases")
    _refuse_expert_parallel(cfg, "routed_experts.inner_experts")
    init = dict(cfg.param_init or {})
    gate_init, up_init = init.pop(GATE, None), init.pop(UP, None)
    if gate_init is not None and up_init is not None:
        init["w13"] = _split_init(gate_init, up_init, cfg.hidden_dim)
    out = derive(cfg, MokgenGroupedExperts.Config, param_init=init or None)
    out.sharding_config = _remap_state_sharding(cfg.sharding_config, "w13", GATE, UP)
    return out


def _fused_shared(cfg) -> bool:
    """Whether mokgen's kernels compute the shared expert of this config (torchtitan's or a
    converted one): a converted one, or torchtitan's plain SwiGLU FeedForward without biases
    whose gate and up have one shape. Any other stays torchtitan's module."""
    if isinstance(cfg, MokgenSharedExpert.Config):
        return True
    if type(cfg) is not FeedForward.Config:
        return False
    shapes = {(c.in_features, c.out_features) for c in (cfg.w1, cfg.w3)}  # gate, up
    return len(shapes) == 1 and not any(c.bias for c in (cfg.w1, cfg.w2, cfg.w3))


def _shared_config(cfg: Module.Config) -> Module.Config:
    """The shared expert's config as MokgenSharedExpert's where mokgen computes it
    (_fused_shared), else torchtitan's, unchanged."""
    if not _fused_shared(cfg):
        return cfg
    gate_init = (cfg.w1.param_init or {}).get("weight")
    up_init = (cfg.w3.param_init or {}).get("weight")
    init = None
    if gate_init is not None and up_init is not None:
        init = {"w13": _split_init(gate_init, up_init, cfg.w1.out_features)}
    out = derive(cfg, MokgenSharedExpert.Config, param_init=init)
    w1_sharding = cfg.w1.sharding_config
    if w1_sharding is not None:
        base = cfg.sharding_config or ShardingConfig()
        out.sharding_config = dataclasses.replace(
            base, state_shardings={"w13": w1_sharding.state_shardings["weight"]})
    return out


@override(target=MoE.Config,
          description="mokgen: the routed and shared experts of every MoE block in one fused "
                      "megakernel per direction; torchtitan's router and checkpoints unchanged")
def mokgen_moe(cfg: MoE.Config, *, tokens_per_rank: int = 16384, dtype: str = "bf16",
               backend: str = "kernels") -> MokgenMoE.Config:
    """torchtitan override factory: `cfg` (a MoE block's config) as a MokgenMoE's.

    tokens_per_rank: the most tokens one call may take (training.local_batch_size x
    training.seq_len); dtype: "bf16", "fp8" or "mxfp8"; backend: "kernels" or "reference".
    Raises ValueError for what mokgen does not run (module docstring)."""
    if isinstance(cfg, MokgenMoE.Config):
        return cfg
    _refuse_other_type(cfg, MoE.Config, "MoE", "torchtitan's MoE")
    if dtype not in DTYPES:
        raise ValueError(f"mokgen_moe: dtype must be one of {DTYPES}, got {dtype!r}")
    if backend not in ("kernels", "reference"):
        raise ValueError(f"mokgen_moe: backend must be 'kernels' or 'reference', got {backend!r}")
    routed = dataclasses.replace(cfg.routed_experts,
                                 inner_experts=_experts_config(cfg.routed_experts.inner_experts))
    shared = None if cfg.shared_experts is None else _shared_config(cfg.shared_experts)
    out = derive(cfg, MokgenMoE.Config, routed_experts=routed, shared_experts=shared,
                 tokens_per_rank=tokens_per_rank, dtype=dtype, backend=backend)
    moe_plan(cfg, tokens_per_rank=tokens_per_rank, dtype=dtype)  # fails at conversion
    return out


def moe_plan(cfg: MoE.Config, *, tokens_per_rank: int = 16384, dtype: str = "bf16"):
    """The plan the mokgen_moe blocks of `cfg` (a MoE block's config, torchtitan's or the
    converted one) run: what MokgenMoE builds, and what compiles their kernels ahead, without
    a GPU (mokgen.pytorch.api.build_plans; the GPU from gpu= rules, $MOKGEN_GPU where no
    device is visible). Raises ValueError as mokgen.plan does."""
    inner, shared = cfg.routed_experts.inner_experts, cfg.shared_experts
    width = shared.w1.out_features if _fused_shared(shared) else None
    shape = MoEShape(cfg.num_experts, inner.dim, inner.hidden_dim, cfg.router.top_k,
                     shared_experts=int(width is not None), shared_intermediate=width,
                     name="torchtitan")
    return make_plan(shape, ep=1, dtype=dtype, tokens_per_rank=tokens_per_rank)


__all__ = ["mokgen_moe", "moe_plan", "MokgenMoE", "MokgenGroupedExperts", "MokgenSharedExpert"]
