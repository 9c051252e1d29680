"""Widths that are not multiples of the tiles on the GPU (marked gpu): their output tiles end
in an edge tile whose columns (rows) past the width are dropped, K tails are zero-filled by
TMA (gemm_tile.cuh cols_valid). Odd multiples of 128 (bf16 and fp8) and multiples of 8 (bf16;
the fp8 plans' bf16 shared expert). Forward and backward against the references; fresh random
inputs per run, outputs poisoned first, bitwise-repeatable."""
import pytest
import torch

import mokgen
from mokgen.workloads import (cosine, make_inputs, reference_grads, reference_outputs,
                              rel_error)

pytestmark = pytest.mark.gpu

SHAPES = {
    # DeepSeek-V2-Lite's D, I (1408 = 11 x 128: dgrad and dW2 end in an edge tile), k and
    # shared width (2 shared experts of 1408), with 16 of its 64 experts
    "v2lite": mokgen.MoEShape(16, 2048, 1408, 6, shared_intermediate=2816),
    # every width an odd multiple of 128: the forward's down tiles, the backward's dx / dW1
    # (across D) and the shared expert's dgrad / dW2 (across IS) end in edge tiles too
    "odd128": mokgen.MoEShape(8, 1152, 640, 2, shared_intermediate=384),
    "odd128-noshared": mokgen.MoEShape(8, 1152, 640, 2, shared_experts=0),
    # multiples of 16 only: K tails (1040 = 16 x 65, 720, 336), gate/up edge tiles of 80
    # columns, down edge tiles of 16, weight-gradient edge rows (D, 2I, 2IS)
    "tail16": mokgen.MoEShape(8, 1040, 720, 2, shared_intermediate=336),
    # multiples of 8 only (not of 16): 16-byte rows, K tails of 8 elements
    "tail8": mokgen.MoEShape(8, 1032, 712, 2, shared_intermediate=328),
    # gpt-oss-20b's widths (hidden = intermediate = 2880) and top-4, 8 of its 32 experts, no
    # shared expert (its activation differs from SwiGLU: shape only)
    "gpt-oss": mokgen.MoEShape(8, 2880, 2880, 4, shared_experts=0),
    # an fp8 plan's bf16 shared expert with a width that is only a multiple of 16
    "fp8-shared-tail": mokgen.MoEShape(8, 1152, 640, 2, shared_intermediate=336),
}
# ~300 tokens x k routes through a 256-row ring: it wraps, and the backward replays
RING = dict(minibatch=128, macrobatch=256)
NAMES = ("x", "router_logits", "w1", "w2", "shared_w1", "shared_w2")


def grads_of(layer, inputs, dys):
    """(outputs, gradients of every input) through autograd over the compiled layer."""
    leaves = {k: ([t.detach().clone().requires_grad_() for t in v] if isinstance(v, list)
                  else None if v is None else v.detach().clone().requires_grad_())
              for k, v in inputs.items()}
    ys = layer(**leaves)
    torch.autograd.backward(ys, dys)
    grads = {k: ([t.grad for t in v] if isinstance(v, list) else None if v is None else v.grad)
             for k, v in leaves.items()}
    return [y.detach() for y in ys], grads


def pairs(ours, ref, k):
    return zip(ours[k], ref[k]) if isinstance(ref[k], list) else [(ours[k], ref[k])]


def run(name, dtype, ep, tokens=300, **overrides):
    shape = SHAPES[name]
    layer = mokgen.compile(shape, ep=ep, dtype=dtype, tokens_per_rank=tokens, virtual=True,
                           **overrides)
    inputs = make_inputs(shape, ep, tokens)
    dys = [torch.randn_like(x) for x in inputs["x"]]
    layer.runtime().poison()
    layer.backward_runtime().poison()
    ys, ours = grads_of(layer, inputs, dys)
    torch.cuda.synchronize()
    layer.synchronize()
    fp8 = None if dtype == "bf16" else dtype
    bad = []
    for r, (y, want) in enumerate(zip(ys, reference_outputs(shape, inputs, fp8=fp8))):
        e = rel_error(y, want)
        if y.isnan().any() or e > 1e-2:
            bad.append(f"y[{r}]: rel {e:.3e}, NaN {bool(y.isnan().any())}")
    same = reference_grads(shape, inputs, dys, fp8=fp8)
    exact = same if fp8 is None else reference_grads(shape, inputs, dys)
    for k in NAMES:
        if same[k] is None:
            continue
        for r, ((g, w), (_, x)) in enumerate(zip(pairs(ours, same, k), pairs(ours, exact, k))):
            if g is None or not torch.isfinite(g).all():
                bad.append(f"{k}[{r}]: missing or not finite")
                continue
            # bf16: the design's bar; fp8: vs the reference quantizing the same operands the
            # same way, and the cosine bar vs the bf16 one (tests/test_gpu_fp8.py)
            err, c = rel_error(g, w), cosine(g, x)
            if err > 2e-2 or c < (0.9999 if fp8 is None else 0.996):
                bad.append(f"{k}[{r}]: rel {err:.3e}, cosine {c:.6f}")
    assert not bad, "; ".join(bad)
    ys2, again = grads_of(layer, inputs, dys)  # same inputs, same kernel: the same bits
    for r, (a, b) in enumerate(zip(ys, ys2)):
        assert torch.equal(a, b), f"y[{r}]: repeated calls differ bitwise"
    for k in NAMES:
        if ours[k] is None:
            continue
        for r, (a, b) in enumerate(pairs(ours, again, k)):
            assert torch.equal(a, b), f"{k}[{r}]: repeated backward calls differ bitwise"


WITH_SHARED = ("v2lite", "odd128")


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("name", WITH_SHARED)
def test_width_128_bf16(name, ep):
    run(name, "bf16", ep, **RING)


@pytest.mark.parametrize("name", WITH_SHARED)
def test_width_128_bf16_planned_ring(name):
    """The planner's own ring (the forward's macrobatch 0 stays resident for the backward)."""
    run(name, "bf16", 2, tokens=500)


@pytest.mark.parametrize("dtype", ["fp8", "mxfp8"])
@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("name", WITH_SHARED)
def test_width_128_fp8(name, ep, dtype):
    run(name, dtype, ep, **RING)


def test_width_128_no_shared_expert():
    run("odd128-noshared", "bf16", 2, **RING)


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("name", ["tail16", "tail8", "gpt-oss"])
def test_width_8_bf16(name, ep):
    run(name, "bf16", ep, **RING)


@pytest.mark.parametrize("dtype", ["fp8", "mxfp8"])
def test_width_8_fp8_shared_expert(dtype):
    run("fp8-shared-tail", dtype, 2, **RING)
