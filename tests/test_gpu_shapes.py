"""Expert counts that are not multiples of 32 and top-k 1, 4, 8 on the GPU, forward and
backward against the reference, on fresh random inputs with poisoned outputs (marked gpu)."""
import dataclasses

import pytest
import torch

import mokgen
from mokgen.harness.workloads import make_inputs, reference_grads, reference_outputs, rel_error
from test_gpu_backward import _equal_grads, check, grads_of, stale_grads

pytestmark = pytest.mark.gpu


def reduced(e: int, k: int) -> mokgen.MoEShape:
    """40 experts: Granite-3.0-3B-A800M's layer (D 1536, I 512, no shared expert) with top-k
    k. 60 experts: Qwen1.5-MoE-A2.7B's count and shared expert at reduced widths (its own
    widths: test_qwen15_moe_at_its_widths)."""
    if e == 40:
        return dataclasses.replace(mokgen.shapes.get("granite-3.0-3b-a800m"), topk=k)
    return mokgen.MoEShape(60, 1024, 512, k, shared_intermediate=1024, name="qwen1.5-reduced")


def check_forward(shape, layer, inputs):
    layer.runtime().poison()
    ys = layer(**inputs)
    torch.cuda.synchronize()
    for r, (y, want) in enumerate(zip(ys, reference_outputs(shape, inputs))):
        assert not y.isnan().any(), f"rank {r}: unwritten (NaN) output elements"
        assert rel_error(y, want) <= 1e-2, f"rank {r}: rel. error {rel_error(y, want):.3e}"


# (E, k, ep): local experts 60, 15, 30, 5 (< k = 8 too), 40, 5
@pytest.mark.parametrize("e,k,ep", [(60, 1, 1), (60, 4, 4), (60, 8, 2), (40, 1, 8), (40, 4, 1),
                                    (40, 8, 8)])
def test_odd_expert_counts_forward_and_backward(e, k, ep):
    check_layer(reduced(e, k), ep, 333)


def check_layer(shape, ep, tokens):
    """Forward and gradients of a virtual-rank layer against the reference, outputs poisoned."""
    layer = mokgen.compile(shape, ep=ep, tokens_per_rank=tokens, virtual=True)
    inputs = make_inputs(shape, ep, tokens)
    check_forward(shape, layer, inputs)
    dys = [torch.randn_like(x) for x in inputs["x"]]
    layer.runtime().poison()
    layer.backward_runtime().poison()
    ours = grads_of(layer, inputs, dys)
    torch.cuda.synchronize()
    layer.synchronize()
    ref = reference_grads(shape, inputs, dys)
    if shape.topk == 1:  # one route's weight is 1 whatever the logits: their gradient is zero
        for r, g in enumerate(ours.pop("router_logits")):
            assert g is not None and g.abs().max() <= 1e-3, f"router_logits[{r}]"
        ref.pop("router_logits")
    check(ours, ref)


def test_qwen15_moe_at_its_widths():
    """60 experts with Qwen1.5-MoE-A2.7B's own widths (I 1408 = 11 x 128: dgrad and dW2 end
    in an edge tile; shared 5632), forward and backward."""
    check_layer(mokgen.shapes.get("qwen1.5-moe-a2.7b"), 4, 200)


@pytest.mark.parametrize("name", mokgen.shapes.PRESETS_MODELS)
def test_every_model_preset_reduced(name):
    """Each public model's layer with its own D, I, k and shared width (so its tails), fewer
    experts (at most 16, and at least k) and 300 tokens over 2 virtual ranks where E allows:
    forward and gradients against the reference."""
    full = mokgen.shapes.get(name)
    e = max(full.topk, min(full.num_experts, 16))
    e += e % 2 if e < full.num_experts else 0  # even where it can be: 2 ranks
    check_layer(dataclasses.replace(full, num_experts=e), 2 if e % 2 == 0 else 1, 300)


@pytest.mark.parametrize("name", mokgen.shapes.PRESETS_MODELS)
def test_every_model_preset_reduced_keep_h_after_other_forwards(name):
    """Each public model's reduced layer at one rank, where keep_h is the default: the
    backward right after its forward runs the resident twin, and after another forward of
    the same workspace the kernel that pulls x (XPULL) on the call's kept h: both right
    against the reference, bitwise equal, nothing replayed. (The x-pulling kernel otherwise
    runs only in a stack of layers: this runs it at every preset's widths and tails.)"""
    full = mokgen.shapes.get(name)
    shape = dataclasses.replace(full, num_experts=max(full.topk, min(full.num_experts, 16)))
    layer = mokgen.compile(shape, ep=1, tokens_per_rank=300, virtual=True)
    assert layer.plan.keep_h and "bwdres" in layer.binaries, name
    inputs = make_inputs(shape, 1, 300)
    dys = [torch.randn_like(x) for x in inputs["x"]]
    rt = layer.runtime()
    rt.poison()
    layer.backward_runtime().poison()
    resident = grads_of(layer, inputs, dys)
    torch.cuda.synchronize()
    ref = reference_grads(shape, inputs, dys)
    if shape.topk == 1:  # one route's weight is 1 whatever the logits: check_layer's note
        ref.pop("router_logits")
    check({k: v for k, v in resident.items() if k in ref}, ref)
    before = dict(rt.stats)
    late = stale_grads(layer, shape, inputs, dys, replays=False)
    torch.cuda.synchronize()
    assert rt.stats["resident_kernel"] == before["resident_kernel"]  # the x-pulling kernel
    _equal_grads(resident, late, "the x-pulling backward differs from the resident one")
