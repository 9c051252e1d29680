"""mokgen as the MoE backend of Hugging Face transformers models (transformers >= 5.17, the
version the tests pin).

`patch(model)` replaces every supported sparse-MoE block (FAMILIES) by a `PatchedMoEBlock`
that keeps the block's own router module (its scoring, top-k, normalization, bias and scaling
as they are: softmax for Qwen3-MoE, Mixtral or OLMoE, grouped sigmoid with a correction bias
and a routed scaling factor for DeepSeek-V3, ...) and hands the chosen routes to mokgen for
dispatch, experts and combine.

Weights: transformers >= 5 stores experts as 3D tensors already in mokgen's layout
(gate_up_proj [E, 2I, D] with gate rows first, down_proj [E, D, I]), so the routed experts are
used in place (the same Parameters: no copy; with expert parallelism, views of this rank's
slice). A shared expert that is a plain SwiGLU MLP added to the routed output (DeepSeek,
GLM-4.5, ERNIE 4.5) runs inside mokgen's call, its three nn.Linear modules kept (its
[2 I_s, D] input weight is one concatenation per call); one scaled by a sigmoid gate (Qwen2-MoE,
Qwen3-Next, Qwen3.5) runs beside it as the block runs it. The block's parameter names are
unchanged, so the model's state dict and checkpoints stay as they are.
"""
from __future__ import annotations

import torch
from torch import nn

from mokgen.compiler.planner import plan as make_plan
from mokgen.pytorch.module import LayerRegistration, group_size_rank
from mokgen.shapes import MoEShape
from mokgen.pytorch import ops

# block class -> (its router's attribute, its shared expert's: None where the family has none,
# and how that expert joins the routed output: "sum" added as it is, "gated" scaled by
# sigmoid(shared_expert_gate(h)))
FAMILIES = {
    "Qwen3MoeSparseMoeBlock": ("gate", None, None),
    "MixtralSparseMoeBlock": ("gate", None, None),
    "OlmoeSparseMoeBlock": ("gate", None, None),
    "MiniMaxSparseMoeBlock": ("gate", None, None),
    "PhimoeSparseMoeBlock": ("router", None, None),
    "GraniteMoeMoE": ("router", None, None),
    "DeepseekV3MoE": ("gate", "shared_experts", "sum"),
    "DeepseekV2Moe": ("gate", "shared_experts", "sum"),
    "Glm4MoeMoE": ("gate", "shared_experts", "sum"),
    "Ernie4_5_MoeSparseMoeBlock": ("gate", "shared_experts", "sum"),
    "Qwen2MoeSparseMoeBlock": ("gate", "shared_expert", "gated"),
    "Qwen3NextSparseMoeBlock": ("gate", "shared_expert", "gated"),
    "Qwen3_5MoeSparseMoeBlock": ("gate", "shared_expert", "gated"),
}


def _plain_swiglu(mlp: nn.Module) -> bool:
    """Whether `mlp` computes down(silu(gate(h)) * up(h)) with bias-free nn.Linear layers: the
    shared expert mokgen's kernels compute."""
    layers = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    act = type(getattr(mlp, "act_fn", None)).__name__
    return all(isinstance(m, nn.Linear) and m.bias is None for m in layers) and \
        act in ("SiLU", "SiLUActivation")


class PatchedMoEBlock(nn.Module):
    def __init__(self, block: nn.Module, ep_group=None, dtype: str = "bf16",
                 tokens_per_rank: int = 8192, backend: str = "kernels",
                 fuse_grad_accumulation: bool | None = None):
        """fuse_grad_accumulation: as mokgen.MoE's (its docstring; None, the default: fused
        where no process group is initialized): once the experts' gate_up_proj / down_proj
        hold a .grad, the backward kernel adds this rank's experts' gradients into their
        slice of it instead of returning new tensors."""
        super().__init__()
        name = type(block).__name__
        if name not in FAMILIES:
            raise ValueError(f"{name} is not a supported MoE block; supported: {sorted(FAMILIES)}")
        self.family = name
        # the block's modules under their own names: the state dict's keys stay the block's
        self._router, shared_attr, joins = FAMILIES[name]
        setattr(self, self._router, getattr(block, self._router))
        self.experts = block.experts
        self._shared = shared_attr if getattr(block, shared_attr or "", None) is not None \
            else None
        self._gated = joins == "gated" and self._shared is not None
        if self._shared:
            setattr(self, self._shared, getattr(block, self._shared))
        if self._gated:
            self.shared_expert_gate = block.shared_expert_gate
        # in mokgen's call: a plain SwiGLU added as it is; the others run beside it, as the
        # block runs them
        self._fused = self._shared is not None and joins == "sum" and \
            _plain_swiglu(getattr(self, self._shared))
        # Mixtral's and MiniMax's multiplicative router noise (Phi-3.5-MoE's input_jitter_noise)
        self.jitter_noise = float(getattr(block, "jitter_noise", None) or
                                  getattr(block, "input_jitter_noise", None) or 0.0)
        if getattr(self.experts, "gate_up_proj", None) is None or \
                getattr(self.experts, "down_proj", None) is None:
            raise ValueError(f"{name}: mokgen uses experts stored as 3D gate_up_proj / "
                             f"down_proj tensors (transformers >= 5 for this family)")
        E, two_i, D = self.experts.gate_up_proj.shape
        act = getattr(getattr(self.experts, "act_fn", None), "__class__", type(None)).__name__
        if act not in ("SiLU", "SiLUActivation"):
            raise ValueError(f"{name}: mokgen implements SwiGLU experts (silu), got {act}")
        biases = [n for n, _ in self.experts.named_parameters() if "bias" in n]
        if biases:
            raise ValueError(f"{name}: mokgen's experts have no biases, these have {biases}")
        shared_dim = None
        if self._fused:
            shared_dim = getattr(self, self._shared).gate_proj.weight.shape[0]
        shape = MoEShape(E, D, two_i // 2, int(getattr(self, self._router).top_k),
                         shared_experts=int(self._fused),
                         shared_intermediate=shared_dim, name=f"hf-{name}")
        ep, rank = group_size_rank(ep_group)
        self.plan = make_plan(shape, ep=ep, dtype=dtype, tokens_per_rank=tokens_per_rank)
        self.rank, self.local = rank, shape.num_experts // ep
        LayerRegistration.attach(self, self.plan, ep_group, backend, fuse_grad_accumulation)

    def _local(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a [E, ...] expert tensor (a view)."""
        lo = self.rank * self.local
        return p[lo:lo + self.local]

    def expert_params(self) -> tuple:
        """The parameters whose .grad slices expert_grads returns."""
        return self.experts.gate_up_proj, self.experts.down_proj

    def expert_grads(self, w1: torch.Tensor, w2: torch.Tensor):
        """The slices of gate_up_proj.grad / down_proj.grad of this rank's experts when the
        call's weights are those parameters' slices (forward uses exactly these views), else
        None. Read by the fused gradient accumulation (mokgen.pytorch.ops._accumulate_into)."""
        p1, p2 = self.expert_params()
        if self._local(p1).data_ptr() != w1.data_ptr() or \
                self._local(p2).data_ptr() != w2.data_ptr():
            return None
        if p1.grad is None or p2.grad is None:
            return None
        return self._local(p1.grad), self._local(p2.grad)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        lead, D = hidden_states.shape[:-1], hidden_states.shape[-1]
        h = hidden_states.reshape(-1, D)
        if self.training and self.jitter_noise > 0:  # multiplicative router noise
            h = h * torch.empty_like(h).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        _, weights, experts = getattr(self, self._router)(h)
        w1 = self._local(self.experts.gate_up_proj)   # views: this rank's experts
        w2 = self._local(self.experts.down_proj)
        shared = getattr(self, self._shared) if self._shared else None
        sw1 = sw2 = None
        if self._fused:
            sw1 = torch.cat([shared.gate_proj.weight, shared.up_proj.weight]).to(w1.dtype)
            sw2 = shared.down_proj.weight.to(w1.dtype)
        y = ops.moe_routed(h.to(w1.dtype), experts.long().contiguous(),
                           weights.float().contiguous(), w1, w2, sw1, sw2,
                           self._registration.handle).to(hidden_states.dtype)
        if shared is not None and not self._fused:
            out = shared(h)
            y = y + (torch.sigmoid(self.shared_expert_gate(h)) * out if self._gated else out)
        return y.reshape(*lead, D)


def patch(model: nn.Module, ep_group=None, dtype: str = "bf16", tokens_per_rank: int = 8192,
          backend: str = "kernels", fuse_grad_accumulation: bool | None = None) -> list:
    """Replace every supported MoE block of `model` in place; returns the names replaced.
    Raises ValueError if the model has none (naming the MoE-like blocks it did find).
    fuse_grad_accumulation: see PatchedMoEBlock (by default fused in one process; True: plain
    training loops with a process group too; not DDP)."""
    targets = [(name, mod) for name, mod in model.named_modules()
               if type(mod).__name__ in FAMILIES]
    if not targets:
        seen = sorted({type(m).__name__ for _, m in model.named_modules()
                       if "moe" in type(m).__name__.lower() or "expert" in type(m).__name__.lower()})
        raise ValueError(f"no supported MoE block in {type(model).__name__} (supported: "
                         f"{sorted(FAMILIES)}; MoE-like modules found: {seen or 'none'})")
    for name, block in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PatchedMoEBlock(block, ep_group, dtype, tokens_per_rank, backend,
                                              fuse_grad_accumulation))
    return [name for name, _ in targets]
