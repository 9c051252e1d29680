"""mokgen.MoE on the GPU: kernels vs the reference backend, autograd, torch.compile (gpu)."""
import copy
import os
import subprocess
import sys

import pytest
import torch

import mokgen

pytestmark = pytest.mark.gpu
SHAPE = mokgen.shapes.get("gpu-small")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def twins():
    ours = mokgen.MoE(SHAPE, tokens_per_rank=512).cuda()
    ref = mokgen.MoE(SHAPE, tokens_per_rank=512, backend="reference").cuda()
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))
    return ours, ref


def test_module_kernels_match_reference_forward_and_backward():
    ours, ref = twins()
    x = torch.randn(4, 100, SHAPE.hidden, device="cuda")
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    yo, yr = ours(xo), ref(xr)
    assert rel(yo, yr) <= 1e-2
    dy = torch.randn_like(yo)
    yo.backward(dy)
    yr.backward(dy)
    assert rel(xo.grad, xr.grad) <= 2e-2
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) <= 2e-2, name


def test_torch_compile_fullgraph_with_kernels():
    torch._dynamo.reset()
    ours, _ = twins()
    x = torch.randn(2, 64, SHAPE.hidden, device="cuda")
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), ours(x))


def test_training_example_converges_and_tracks_the_reference():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "examples", "03_train_small_lm.py"),
                          "--steps", "150"], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root}).stdout
    import json

    s = json.loads(out)
    assert s["device"] == "cuda"
    assert s["last"][0] < 0.85 * s["first"][0], "loss must go down"
    assert s["max_rel_gap"] <= 0.05, f"mokgen and reference losses diverged: {s}"
