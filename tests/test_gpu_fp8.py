"""The fp8 forward megakernel (dtype "fp8": blockwise, "mxfp8": OCP MX) on the GPU against the
references (marked gpu: skipped without one)."""
import pytest
import torch

import mokgen
from mokgen import quant
from mokgen.harness.workloads import cosine, make_inputs, reference_grads, reference_outputs, rel_error
from mokgen.pytorch import ops
from mokgen.pytorch.api import memory_report
from mokgen.runtime.workspace import nbytes

pytestmark = pytest.mark.gpu
FORMATS = ["fp8", "mxfp8"]


def run_checked(fmt, shape, ep, tokens, skew=None, **overrides):
    layer = mokgen.compile(shape, ep=ep, dtype=fmt, tokens_per_rank=tokens, virtual=True,
                           **overrides)
    inputs = make_inputs(shape, ep, tokens, skew=skew)
    layer.runtime().poison()
    ys = layer(**inputs)
    torch.cuda.synchronize()
    same = reference_outputs(shape, inputs, fp8=fmt)  # the same operands, quantized the same way
    exact = reference_outputs(shape, inputs)
    for r, (y, want, bf) in enumerate(zip(ys, same, exact)):
        assert not y.isnan().any(), f"rank {r}: unwritten (NaN) output elements"
        assert rel_error(y, want) <= 1e-2, f"rank {r}: vs quantized ref {rel_error(y, want):.3e}"
        assert rel_error(y, bf) <= 6e-2, f"rank {r}: vs bf16 ref {rel_error(y, bf):.3e}"
    return layer, inputs, ys


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ep,tokens", [(1, 1000), (4, 777)])
def test_fp8_forward_matches_the_quantized_reference(fmt, ep, tokens):
    run_checked(fmt, mokgen.shapes.get("gpu-small"), ep, tokens)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_ring_wraps_and_skew(fmt):
    shape = mokgen.shapes.get("gpu-small")
    run_checked(fmt, shape, 4, 900, minibatch=128, macrobatch=256)
    run_checked(fmt, shape, 4, 600, skew="sparse")


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_preset_slice(fmt):
    run_checked(fmt, mokgen.shapes.get("kimi-k2.7"), 8, 256)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_quantization_equals_mokgen_quant(fmt):
    """Dispatch: every ring row is bit for bit mokgen.quant of its source token (data and
    scales; quantized once by the owner, pulled as e4m3). SwiGLU epilogue: its blocks are
    valid quantizations (requantizing the dequantized values is the identity for MX) and
    close to the reference's quantization of the same rows (the fp32 sums differ in order)."""
    shape = mokgen.shapes.get("gpu-small")
    layer, inputs, _ = run_checked(fmt, shape, 2, 300)
    rt = layer.runtime()
    b, K, D = rt.ranks[0], shape.topk, shape.hidden
    rows = min(int(b.meta[0].item()), rt.spec.macrobatch)  # the ring holds macrobatch 0
    table = b.table[:rows].long().cpu()
    live = table[:, 0] >= 0
    src = torch.stack([inputs["x"][r][j // K] if r >= 0 else torch.zeros(D, dtype=torch.bfloat16,
                                                                          device="cuda")
                       for r, j in table.tolist()])
    got_q = b.ring_x8[:rows].view(torch.float8_e4m3fn)
    got_s = b.ring_sx[:, :rows].t()
    if fmt == "mxfp8":  # the kernel keeps 2^(e - 127) as fp32: compare the e8m0 bytes
        want_q, want_s = quant.to_mxfp8(src)
        bits = got_s.contiguous().view(torch.int32)
        got_s = torch.where(bits == 0x00400000, 0, (bits >> 23) & 0xFF).to(torch.uint8)
    else:
        want_q, want_s = quant.to_fp8_blockwise(src)
    assert live.any()
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), "dispatch data"
    assert torch.equal(got_s, want_s), "dispatch scales"

    a = quant.from_fp8_blockwise(b.ring_a8[:rows].view(torch.float8_e4m3fn),
                                 b.ring_sa[:, :rows].t().contiguous(), (1, rt.spec.scale_block))
    # the reference SwiGLU output of the live rows, from the same quantized operands
    e = torch.searchsorted(b.offsets[1:].cpu(), torch.arange(rows), right=True)
    w1 = inputs["w1"][0].float()
    rows_checked = torch.nonzero(live).flatten().tolist()[:64]
    want = []
    for i in rows_checked:
        g, u = (quant.fake_quant(src[i:i + 1].float(), fmt)
                @ quant.fake_quant(w1[e[i]], fmt, weight=True).T).chunk(2, dim=-1)
        want.append(quant.fake_quant(torch.nn.functional.silu(g) * u, fmt))
    # the fp32 sums differ in order, which flips an element's e4m3 rounding now and then
    err = rel_error(a[rows_checked], torch.cat(want))
    assert err <= 2e-2, f"SwiGLU output vs the reference's quantization: {err:.3e}"
    if fmt == "mxfp8":
        q2, b2 = quant.to_mxfp8(a[live])
        assert torch.equal(q2.view(torch.uint8),
                           b.ring_a8[:rows][live]), "SwiGLU blocks are not MX-canonical"


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_forward_is_deterministic(fmt):
    shape = mokgen.shapes.get("gpu-small")
    layer, inputs, first = run_checked(fmt, shape, 4, 500)
    again = layer(**inputs)
    for a, b in zip(first, again):
        assert torch.equal(a, b), "repeated calls differ bitwise"


def grads_of(layer, inputs, dys):
    """Our gradients through autograd over the compiled layer."""
    leaves = {k: ([t.detach().requires_grad_() for t in v] if isinstance(v, list)
                  else v.detach().requires_grad_()) for k, v in inputs.items()}
    ys = layer(**leaves)
    torch.autograd.backward(ys, dys)
    return {k: ([t.grad for t in v] if isinstance(v, list) else v.grad)
            for k, v in leaves.items()}


def check_grads(ours, same, exact):
    """vs the reference that quantizes the same operands the same way: rel. error <= 2e-2
    (the routed experts' products come from e4m3 operands whose rounding flips with the fp32
    sum order, and the weight gradients take those products); vs the bf16 reference: cosine
    >= 0.996 (the issue's bar)."""
    bad = []
    for k in ("x", "router_logits", "w1", "w2", "shared_w1", "shared_w2"):
        pairs = zip(ours[k], same[k], exact[k]) if isinstance(ours[k], list) \
            else [(ours[k], same[k], exact[k])]
        for r, (g, w, e) in enumerate(pairs):
            if g is None or not torch.isfinite(g).all():
                bad.append(f"{k}[{r}]: missing or not finite")
                continue
            err, c = rel_error(g, w), cosine(g, e)
            if err > 2e-2 or c < 0.996:
                bad.append(f"{k}[{r}]: vs quantized ref {err:.3e}, cosine vs bf16 {c:.5f}")
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ep,tokens,overrides", [
    (2, 400, {}),
    # ~3600 rows through a 256-row ring: the ring wraps many times
    (4, 900, dict(minibatch=128, macrobatch=256))])
def test_fp8_backward_matches_the_quantized_reference(fmt, ep, tokens, overrides):
    """The fp8 backward megakernel (replay, dgrad and dx in e4m3, weight gradients in bf16)
    against the reference that quantizes as it does, and against the bf16 reference."""
    shape = mokgen.shapes.get("gpu-small")
    layer = mokgen.compile(shape, ep=ep, dtype=fmt, tokens_per_rank=tokens, virtual=True,
                           **overrides)
    inputs = make_inputs(shape, ep, tokens)
    dys = [torch.randn_like(x) for x in inputs["x"]]
    layer.runtime().poison()
    layer.backward_runtime().poison()
    ours = grads_of(layer, inputs, dys)
    torch.cuda.synchronize()
    check_grads(ours, reference_grads(shape, inputs, dys, fp8=fmt),
                reference_grads(shape, inputs, dys))
    # each rank's quantized weights, the forward's layout as memory_report predicts them;
    # the backward's transposed copy went with it
    held = [nbytes(getattr(e, f) for f in ("w1", "s1", "w2", "s2"))
            for e in layer._weights._cache.values() if not hasattr(e, "t")]
    assert held == [memory_report(layer.plan)["quantized_weights_per_layer"]] * ep
    if overrides:  # every ring slot was written: its e4m3 rows are mokgen.quant of its bf16
        # (dy is quantized by the same pull as x; dh, bf16, lands over the pre-activations)
        sc, b = layer.backward_runtime().scratch[-1], layer.runtime().ranks[-1]
        for name, bf16, q8, scales in (("x", b.ring_x, b.ring_x8, b.ring_sx),
                                       ("dh", b.ring_h, sc.ring_dh8, sc.ring_sdh)):
            assert_quantized(name, fmt, bf16, q8, scales)


def assert_quantized(name, fmt, bf16, q8, scales):
    """A ring's e4m3 rows and scale-major fp32 scales are bit for bit mokgen.quant of its
    bf16 rows."""
    if fmt == "mxfp8":  # the kernels keep 2^(e - 127) as fp32: compare the e8m0 bytes
        want_q, want_s = quant.to_mxfp8(bf16)
        bits = scales.t().contiguous().view(torch.int32)
        got_s = torch.where(bits == 0x00400000, 0, (bits >> 23) & 0xFF).to(torch.uint8)
    else:
        want_q, want_s = quant.to_fp8_blockwise(bf16)
        got_s = scales.t()
    assert not bf16.isnan().any(), f"{name}: unwritten ring rows"
    assert torch.equal(q8, want_q.view(torch.uint8)), f"{name}: e4m3 data"
    assert torch.equal(got_s, want_s), f"{name}: scales"


def test_fp8_backward_is_deterministic():
    shape = mokgen.shapes.get("gpu-small")
    layer = mokgen.compile(shape, ep=4, dtype="fp8", tokens_per_rank=500, virtual=True)
    inputs = make_inputs(shape, 4, 500)
    dys = [torch.randn_like(x) for x in inputs["x"]]
    first, again = grads_of(layer, inputs, dys), grads_of(layer, inputs, dys)
    for k in ("x", "w1", "w2", "router_logits"):
        for a, b in zip(first[k], again[k]):
            assert torch.equal(a, b), f"{k}: repeated backward calls differ bitwise"


def test_an_optimizer_step_frees_the_quantized_weights_it_makes_stale():
    """After a training step's backward the layer holds its quantized weights (the forward's
    layout, as memory_report says: the backward freed its transposed copy); an optimizer step
    over its weights frees them before it updates them, and the next step quantizes the new
    weights (its output: a fresh layer's on them)."""
    shape = mokgen.shapes.get("gpu-small")
    torch.manual_seed(0)
    layer = mokgen.MoE(shape, tokens_per_rank=256, dtype="fp8", device="cuda")
    x = torch.randn(256, shape.hidden, device="cuda")
    layer(x).float().square().mean().backward()
    cache = ops.kernels_of(layer._layer).layer()._weights._cache
    held = memory_report(layer.plan)["quantized_weights_per_layer"]
    assert len(cache) == 1 and held > 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.optim.SGD(layer.parameters(), lr=1e-2).step()  # no state: frees, allocates nothing
    torch.cuda.synchronize()
    assert not cache and before - torch.cuda.memory_allocated() == held
    with torch.no_grad():
        fresh = mokgen.MoE(shape, tokens_per_rank=256, dtype="fp8", device="cuda")
        fresh.load_state_dict(layer.state_dict())
        assert torch.equal(layer(x), fresh(x))


def test_fp8_layer_under_fsdp2_quantizes_each_steps_new_weights(nccl_rank):
    """FSDP2 (one NCCL rank) all-gathers its stepped shards into the same unsharded
    parameters each forward and keeps their version counters: after each optimizer step the
    layer's output is a fresh layer's on the new weights, bit for bit (a weight cache keyed
    on identity and version alone kept step 0's quantized weights)."""
    from torch.distributed.fsdp import fully_shard

    shape = mokgen.shapes.get("gpu-small")
    torch.manual_seed(torch.seed() % 2**31)
    layer = mokgen.MoE(shape, tokens_per_rank=256, dtype="fp8", device="cuda")
    fully_shard(layer)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    x = torch.randn(256, shape.hidden, device="cuda")
    for _ in range(3):
        layer(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            fresh = mokgen.MoE(shape, tokens_per_rank=256, dtype="fp8", device="cuda")
            fresh.load_state_dict({k: v.full_tensor() if hasattr(v, "full_tensor") else v
                                   for k, v in layer.state_dict().items()})
            assert torch.equal(layer(x), fresh(x))
