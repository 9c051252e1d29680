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


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_a_call_with_no_backward_keeps_nothing_and_matches(dtype):
    """Under no_grad, or with no input requiring grad, the module's call runs the kernels
    without saving (no kept h, no bf16 copies of an fp8 layer's h and a): bitwise the output
    of a differentiable call, and the runtime records it kept nothing."""
    from mokgen.pytorch import ops

    layer = mokgen.MoE(SHAPE, tokens_per_rank=512, dtype=dtype).cuda()
    rt = ops.kernels_of(layer._layer).layer().runtime()
    x = torch.randn(512, SHAPE.hidden, device="cuda")
    y = layer(x.clone().requires_grad_())
    assert rt.saved
    with torch.no_grad():
        assert torch.equal(layer(x), y.detach()) and not rt.saved
    for p in layer.parameters():
        p.requires_grad_(False)  # frozen weights and an input without grad: no backward either
    assert torch.equal(layer(x), y.detach()) and not rt.saved


def test_torch_compile_fullgraph_with_kernels():
    torch._dynamo.reset()
    ours, _ = twins()
    x = torch.randn(2, 64, SHAPE.hidden, device="cuda")
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), ours(x))


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "mxfp8"])
def test_cuda_graph_replays_training_steps_bitwise(dtype):
    """A training step (forward, backward into fresh gradients) captured in a CUDA graph once
    warm-up calls made the workspace and kernels exist, with an optimizer step between
    replays (eager, as torchtitan's trainer runs it): each replay on new inputs copied into
    the static ones gives eager's output and gradients on the weights as they are then, bit
    for bit (the host then pays one graph launch a step; the watchdog's record is read at
    capture only). fp8 / MXFP8: the capture holds its own weight quantization (WeightCache),
    so every replay quantizes the stepped weights. The caller routes (router=False), so every
    kernel in the step is mokgen's: cuBLAS may pick another kernel on the capture stream."""
    ours = mokgen.MoE(SHAPE, tokens_per_rank=512, router=False, dtype=dtype).cuda()
    names, params = zip(*ours.named_parameters())
    sx = torch.randn(4, 100, SHAPE.hidden, device="cuda").requires_grad_()
    sz = torch.randn(4, 100, SHAPE.num_experts, device="cuda").requires_grad_()
    sdy = torch.randn_like(sx)
    leaves = list(params) + [sx, sz]

    def step():
        for t in leaves:
            t.grad = None
        y = ours(sx, router_logits=sz)
        y.backward(sdy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sy = step()
    # the graph writes these on every replay (replays do not touch the .grad attributes)
    static = [sy] + [t.grad for t in leaves]
    opt = torch.optim.SGD(params, lr=0.1)
    probe = torch.randn_like(sx[0]), torch.randn_like(sz[0])
    probed = []  # eager outputs on one input after each step: the steps change what it sees
    for _ in range(3):
        x, z, dy = torch.randn_like(sx), torch.randn_like(sz), torch.randn_like(sdy)
        with torch.no_grad():
            sx.copy_(x)
            sz.copy_(z)
            sdy.copy_(dy)
        graph.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in static]
        xe, ze = x.clone().requires_grad_(), z.clone().requires_grad_()
        for p in params:
            p.grad = None
        ye = ours(xe, router_logits=ze)
        ye.backward(dy)
        want = [ye] + [p.grad for p in params] + [xe.grad, ze.grad]
        for name, a, b in zip(("y",) + names + ("x", "router_logits"), got, want):
            assert torch.equal(a, b), f"{name}: graph replay differs from eager"
        with torch.no_grad():
            probed.append(ours(probe[0], router_logits=probe[1]))
        for p, g in zip(params, static[1:]):
            p.grad = g  # the replay's gradients, which the step reads
        opt.step()
    assert not torch.equal(probed[0], probed[1]) and not torch.equal(probed[1], probed[2])


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
