"""mokgen: a compiler of fused, persistent MoE megakernels (Mixture-of-Kittens on Hopper)."""
from __future__ import annotations

from mokgen import shapes
from mokgen.compiler.plan import Plan
from mokgen.compiler.planner import plan
from mokgen.shapes import MoEShape
from mokgen.version import __version__


def compile(shape: MoEShape, ep: int, dtype: str = "bf16", tokens_per_rank: int = 2048,
            virtual: bool = False, group=None, watchdog_s: float | None = None, **overrides):
    """plan + emit + build (+ load where a GPU is present); returns the callable layer.

    virtual=True hosts all `ep` ranks on this GPU (inputs are lists of per-rank tensors);
    otherwise this process is one rank of `group` (default: the world), whose size is `ep`,
    and peers are reached through torch symmetric memory. `watchdog_s` bounds every device
    wait (default $MOKGEN_WATCHDOG, 5 s): past it the call is abandoned and the layer raises
    RuntimeError naming the rank, phase and flag (at the next call or `moe.synchronize()`).
    A result of `python -m mokgen tune` for this problem supplies minibatch and comm SMs
    unless either is overridden here (or SMs are reserved). `overlap_comm=True`: collectives
    run beside the layer (FSDP gathers on a side stream); the kernels leave them SMs (H100 /
    H200: 16, passes/sm_partition.py); `reserve_sms=n` forces the count.

    The GPU: by default $MOKGEN_GPU where set, else the current CUDA device (its SM count,
    shared memory and memory, with the rates of its kind: mokgen/compiler/hardware.py), else
    the H200. `gpu="h100-sxm"` (or "h200", "h800", "h100-pcie", "h20")
    plans and builds for that GPU on any machine: kernels built ahead so are the ones that
    GPU finds in the cache. A layer loaded on a GPU whose SM count or shared memory differs
    from its plan's is refused (ValueError naming both)."""
    from mokgen.pytorch.api import compile_layer
    from mokgen.compiler.tuned import tuned_plan

    return compile_layer(tuned_plan(shape, ep, dtype, tokens_per_rank, **overrides),
                         virtual=virtual, group=group, watchdog_s=watchdog_s)


def __getattr__(name):  # the nn.Module pulls in torch.library registration: load on use
    if name == "MoE":
        from mokgen.pytorch.module import MoE

        return MoE
    if name == "patch":
        from mokgen.integrations.transformers import patch

        return patch
    raise AttributeError(f"module 'mokgen' has no attribute {name!r}")


__all__ = ["MoE", "MoEShape", "Plan", "plan", "compile", "patch", "shapes", "__version__"]
