"""mokgen as the MoE backend of Hugging Face transformers models (transformers >= 5).

`patch(model)` replaces every supported sparse-MoE block by a `PatchedMoEBlock` that keeps the
block's own router module (its scoring, top-k, normalization, bias and scaling as they are:
softmax for Qwen3-MoE and Mixtral, grouped sigmoid with a correction bias and a routed scaling
factor for DeepSeek-V3) and hands the chosen routes to mokgen for dispatch, experts and combine.

Weights: transformers >= 5 stores experts as 3D tensors already in mokgen's layout
(gate_up_proj [E, 2I, D] with gate rows first, down_proj [E, D, I]), so the routed experts are
used in place (the same Parameters: no copy; with expert parallelism, views of this rank's
slice). A shared expert (DeepSeek-V3) keeps its three nn.Linear modules; its [2 I_s, D] input
weight is one concatenation per call. The block's parameter names are unchanged, so the
model's state dict and checkpoints stay as they are.
"""
from __future__ import annotations

import torch
from torch import nn

from mokgen.compiler.planner import plan as make_plan
from mokgen.pytorch.module import LayerRegistration, group_size_rank
from mokgen.shapes import MoEShape
from mokgen.pytorch import ops

# block class -> attribute of its shared expert (None: the family has none)
FAMILIES = {
    "Qwen3MoeSparseMoeBlock": None,
    "MixtralSparseMoeBlock": None,
    "DeepseekV3MoE": "shared_experts",
}


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
        self.gate, self.experts = block.gate, block.experts
        shared_attr = FAMILIES[name]
        self.shared_experts = getattr(block, shared_attr) if shared_attr else None
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        E, two_i, D = self.experts.gate_up_proj.shape
        act = getattr(getattr(self.experts, "act_fn", None), "__class__", type(None)).__name__
        if act not in ("SiLU", "SiLUActivation"):
            raise ValueError(f"{name}: mokgen implements SwiGLU experts (silu), got {act}")
        shared_dim = None
        if self.shared_experts is not None:
            shared_dim = self.shared_experts.gate_proj.weight.shape[0]
        shape = MoEShape(E, D, two_i // 2, int(self.gate.top_k),
                         shared_experts=int(self.shared_experts is not None),
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
        if self.training and self.jitter_noise > 0:  # Mixtral's multiplicative router noise
            h = h * torch.empty_like(h).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        _, weights, experts = self.gate(h)
        w1 = self._local(self.experts.gate_up_proj)   # views: this rank's experts
        w2 = self._local(self.experts.down_proj)
        sw1 = sw2 = None
        if self.shared_experts is not None:
            se = self.shared_experts
            sw1 = torch.cat([se.gate_proj.weight, se.up_proj.weight]).to(w1.dtype)
            sw2 = se.down_proj.weight.to(w1.dtype)
        y = ops.moe_routed(h.to(w1.dtype), experts.long().contiguous(),
                           weights.float().contiguous(), w1, w2, sw1, sw2,
                           self._registration.handle)
        return y.to(hidden_states.dtype).reshape(*lead, D)


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
