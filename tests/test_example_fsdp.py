"""examples/04_train_fsdp_ep.py on CPU: FSDP2 on the dense parameters and EP = 2 through the
torch-native EP layer (gloo, two processes) track the single-process reference step by step
(fp32: to rounding). The mokgen layer in its place needs GPUs (benchmarks/run_gpu.sh
multigpu-tests)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo on Linux")
def test_fsdp2_with_expert_parallel_layers_matches_the_reference(tmp_path):
    out = tmp_path / "summary.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--standalone", str(ROOT / "examples/04_train_fsdp_ep.py"),
           "--moe", "torch", "--warmup", "2", "--seq", "16", "--batch", "4", "--layers", "1",
           "--out", str(out)]
    # bf16 experts beside fp32 routers and embeddings, as on GPUs (an FSDP unit holds one
    # dtype: the example shards each router apart)
    res = subprocess.run(cmd + ["--steps", "8", "--expert-dtype", "bf16"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["ranks"] == 2 and len(s["losses"]) == len(s["ref_losses"]) == 8
    assert s["max_rel_gap"] < 2e-2 and s["last"] < s["first"]
    # fp32: a few steps show the same sums up to rounding (each step's loss is compared)
    res = subprocess.run(cmd + ["--steps", "4"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads(out.read_text())
    assert len(s["losses"]) == 4 and s["max_rel_gap"] < 1e-5  # fp32: the same sums up to rounding
