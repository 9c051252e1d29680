"""Does torchtitan's selective activation checkpointing run mokgen's forward twice a step, and
does adding mokgen's forward ops to its save list stop that? (lab/NOTES.md section 4 item 9;
CPU: mokgen's reference backend, torchtitan's parallelize_qwen3 with per-block torch.compile
on aot_eager, FSDP2 on one gloo rank, as tests/test_torchtitan.py runs it.) Counts the calls
of mokgen's routed forward in one training step without AC, with torchtitan's SelectiveAC and
with the save list extended, prints each time the policy is asked about a mokgen op, and
compares the gradients. At 2026-12-07 (torch 2.13, torchtitan 0.3): 2 / 2+2 / 2+2 calls, and
the policy is asked about no op at all (a debug copy logged every op: none) while mokgen's op
body runs with grad off, not compiling, no dispatch mode: under per-block compile the
checkpointed block reruns mokgen's forward in the backward, and no save list reaches it.

    python lab/tt_sac_check.py
"""
from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mokgen.pytorch import ops  # noqa: E402

CALLS = [0]
_impl = ops._forward_routed_impl


def counted(*args, **kwargs):
    CALLS[0] += 1
    return _impl(*args, **kwargs)


ops._forward_routed_impl = counted


def model(save_mokgen: bool, tmp: str):
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import model_registry, parallelize_qwen3
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    class SaveMokgen(SelectiveAC):  # mokgen's forward ops saved, as matmuls and attention are
        @dataclass(kw_only=True, slots=True)
        class Config(SelectiveAC.Config):
            pass

        def get_save_ops(self):
            class Logged(set):
                def __contains__(self, op):
                    if "mokgen" in str(op):
                        print("  policy asked about", op, set.__contains__(self, op))
                    return set.__contains__(self, op)
            return Logged(super().get_save_ops() | {torch.ops.mokgen.moe_forward.default,
                                                    torch.ops.mokgen.moe_forward_routed.default})

    parallel_dims.device_type = "cpu"
    parallelism = ParallelismConfig()
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    cfg = model_registry("debugmodel_moe").model
    cfg.layers = cfg.layers[:2]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=False)
    apply_overrides(OverrideConfig(imports=[("mokgen.integrations.torchtitan.mokgen_moe",
                                             {"tokens_per_rank": 256})]), cfg)
    with torch.device("meta"):
        m = cfg.build()
    m.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        m.init_states()
    ac = None if save_mokgen is None else (SaveMokgen if save_mokgen else SelectiveAC).Config()
    return parallelize_qwen3(m, parallel_dims=ParallelDims.from_config(parallelism, 1),
                             training=TrainingConfig(), parallelism=parallelism,
                             compile_config=CompileConfig(enable=True, backend="aot_eager"),
                             ac_config=ac, dump_folder=tmp), cfg.vocab_size


def main() -> int:
    import torch.distributed as dist

    tmp = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
    try:
        grads = {}
        for save in (None, False, True):
            m, vocab = model(save, tmp)
            tokens = torch.randint(0, vocab, (2, 128), generator=torch.Generator().manual_seed(1))
            CALLS[0] = 0
            loss = m(tokens).float().logsumexp(-1).mean()
            fwd = CALLS[0]
            loss.backward()
            print(f"save mokgen's forward: {save}: {fwd} forward calls, "
                  f"{CALLS[0] - fwd} more in the backward")
            grads[save] = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                           for n, p in m.named_parameters() if p.grad is not None}
        worst = max((a - grads[True][n]).abs().max().item() / max(a.abs().max().item(), 1e-30)
                    for n, a in grads[False].items())
        print(f"gradients both ways: largest relative difference {worst:.2e}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
