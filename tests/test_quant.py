"""MXFP8 quantization against hand-computed blocks (OCP MX v1.0)."""
import re

import pytest
import torch

from mokgen import quant
from mokgen.quant import from_mxfp8, to_mxfp8
from mokgen.runtime import weight_quant


def block(values):
    return torch.tensor(values + [0.0] * (32 - len(values)), dtype=torch.float32)


def q1(values):
    data, scales = to_mxfp8(block(values))
    return data.float(), int(scales[0]), from_mxfp8(data, scales)


def test_powers_of_two_round_trip_exactly():
    data, s, back = q1([2.0 ** k for k in range(-6, 4)])  # amax 8 = 2^3
    assert s == 3 - 8 + 127                              # X = 2^(3 - 8)
    assert data[9] == 256.0 and data[0] == 2.0 ** (-6 + 5)
    assert torch.equal(back, block([2.0 ** k for k in range(-6, 4)]))


def test_max_magnitude_saturates_to_448():
    data, s, back = q1([1.9 * 8, -1.9 * 8, 1.0])          # 15.2 / 2^-5 = 486.4 > 448
    assert s == 3 - 8 + 127
    assert data[0] == 448.0 and data[1] == -448.0
    assert back[0] == 14.0 and back[1] == -14.0 and back[2] == 1.0


def test_zero_block():
    data, scales = to_mxfp8(torch.zeros(2, 64))
    assert torch.all(scales == 0) and torch.all(data.float() == 0)
    assert torch.equal(from_mxfp8(data, scales), torch.zeros(2, 64))


def test_negative_values_mirror_positive_ones():
    x = torch.randn(4, 96)
    dp, sp = to_mxfp8(x.abs())
    dn, sn = to_mxfp8(-x.abs())
    assert torch.equal(sp, sn) and torch.equal(dn.float(), -dp.float())


def test_all_equal_block():
    data, scales = to_mxfp8(torch.full((32,), 3.0))
    assert int(scales[0]) == 1 - 8 + 127 and torch.all(data.float() == 384.0)  # 1.5 * 2^8
    assert torch.all(from_mxfp8(data, scales) == 3.0)


def test_round_to_nearest_even_and_subnormals():
    # amax 448 -> X = 2^(8 - 8) = 1: elements are cast as they are
    data, s, _ = q1([448.0, 17.0, 19.0, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10])
    assert s == 127
    assert data[1] == 16.0    # 17 ties 16 / 18: even mantissa
    assert data[2] == 20.0    # 19 ties 18 / 20: even mantissa
    assert data[3] == 2.0 ** -9                        # smallest subnormal kept
    assert data[4] == 0.0                              # half of it ties to zero (even)
    assert data[5] == 2.0 ** -8                        # 1.5 subnormal steps -> 2 (even)


def test_non_finite_blocks_become_nan_and_others_stay():
    x = torch.ones(2, 32)
    x[0, 5] = float("inf")
    data, scales = to_mxfp8(x)
    assert int(scales[0, 0]) == 255 and int(scales[1, 0]) == 0 + 127 - 8
    back = from_mxfp8(data, scales)
    assert back[0].isnan().all() and torch.equal(back[1], torch.ones(32))


def test_dim_argument_and_errors():
    x = torch.randn(64, 3)
    data, scales = to_mxfp8(x, dim=0)
    assert data.shape == (64, 3) and scales.shape == (2, 3)
    err = (from_mxfp8(data, scales, dim=0) - x).abs() / x.abs().amax(0)
    # the spec's scale lets amax reach up to 512 X, above e4m3's 448: saturation loses up to
    # 64 / 512 of the block max; elsewhere a half-ulp of 3 mantissa bits
    assert err.max() <= 0.125
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        from_mxfp8(x, scales, dim=0)


def test_quantize_weight_reference_layouts_on_cpu():
    w = torch.randn(3, 64, 96)
    d, s = quant.quantize_weight(w)
    rd, rs = quant.to_mxfp8(w)
    assert torch.equal(d.view(torch.uint8), rd.view(torch.uint8)) and torch.equal(s, rs)
    d, s = quant.quantize_weight(w, transposed=True)
    assert d.shape == (3, 96, 64) and s.shape == (3, 96, 2)
    rd, rs = quant.to_mxfp8(w.transpose(-1, -2).contiguous())
    assert torch.equal(d.view(torch.uint8), rd.view(torch.uint8)) and torch.equal(s, rs)
    d, s = quant.quantize_weight(torch.randn(48, 64), transposed=True)  # a partial block
    assert d.shape == (64, 48) and s.shape == (64, 2)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        quant.quantize_weight(torch.randn(32, 32).half())


# ---------------------------------------------------------------- partial blocks (issue #16)
# A width that is a multiple of 16 but not of the block (gpt-oss's 2880 = 22.5 x 128; 48 =
# 1.5 MX blocks) ends in a partial block: quantized as if padded with zeros, which leaves its
# scale as the amax of the elements it has; its scales count ceil(size / block).
def test_mx_partial_block_is_the_zero_padded_one():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 80, generator=g) * 10
    data, scales = to_mxfp8(x)
    assert data.shape == (3, 80) and scales.shape == (3, 3)
    padded = torch.cat([x, torch.zeros(3, 16)], 1)
    pd, ps = to_mxfp8(padded)
    assert torch.equal(scales, ps)
    assert torch.equal(data.view(torch.uint8), pd.view(torch.uint8)[:, :80])
    assert torch.equal(from_mxfp8(data, scales), from_mxfp8(pd, ps)[:, :80])
    # the partial block's scale is its 16 elements' amax (the zeros leave it unchanged)
    tail = x[:, 64:].abs().amax(-1)
    assert torch.equal(scales[:, 2].long(), torch.frexp(tail)[1].long() - 1 - 8 + 127)
    # along another dim, and a tensor smaller than one block
    d0, s0 = to_mxfp8(x.t().contiguous(), dim=0)
    assert s0.shape == (3, 3) and torch.equal(s0.t(), ps[:, :3].contiguous().t().t())
    d1, s1 = to_mxfp8(torch.full((16,), 3.0))
    assert s1.shape == (1,) and int(s1[0]) == 1 - 8 + 127 and torch.all(d1.float() == 384.0)


def test_blockwise_partial_blocks_are_the_zero_padded_ones():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(2, 144, 208, generator=g)       # 1.125 x 1.625 blocks of 128
    data, scales = quant.to_fp8_blockwise(w, quant.WEIGHT_BLOCK)
    assert data.shape == w.shape and scales.shape == (2, 2, 2)
    padded = torch.zeros(2, 256, 256)
    padded[:, :144, :208] = w
    pd, ps = quant.to_fp8_blockwise(padded, quant.WEIGHT_BLOCK)
    assert torch.equal(scales, ps)
    assert torch.equal(data.view(torch.uint8), pd.view(torch.uint8)[:, :144, :208])
    assert torch.equal(scales[:, 1, 1], w[:, 128:, 128:].abs().amax((-2, -1)) / 448.0)
    back = quant.from_fp8_blockwise(data, scales, quant.WEIGHT_BLOCK)
    assert torch.equal(back, quant.from_fp8_blockwise(pd, ps, quant.WEIGHT_BLOCK)[:, :144, :208])
    a = torch.randn(5, 2880, generator=g)           # activations: 1 x 128, 22.5 blocks a row
    ad, asc = quant.to_fp8_blockwise(a)
    assert ad.shape == (5, 2880) and asc.shape == (5, 23)
    assert torch.equal(asc[:, 22], a[:, 2816:].abs().amax(-1) / 448.0)
    # the CPU weight entry points take them too, bit for bit the references
    d, s = quant.quantize_weight_blockwise(w)
    assert torch.equal(d.view(torch.uint8), data.view(torch.uint8)) and torch.equal(s, scales)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_fake_quant_halves_block_gate_and_up_apart(fmt):
    """W1's gate and up rows, dh's and W1^T's 2I columns: each half blocked on its own (the
    kernels pad each to whole blocks); the same as one pass when the halves are whole
    blocks."""
    g = torch.Generator().manual_seed(7)
    I, D = 144, 208
    w1 = torch.randn(2 * I, D, generator=g)
    got = quant.fake_quant(w1, fmt, weight=True, halves=-2)
    want = torch.cat([quant.fake_quant(w1[:I], fmt, True), quant.fake_quant(w1[I:], fmt, True)])
    assert torch.equal(got, want)
    dh = torch.randn(4, 2 * I, generator=g)
    got = quant.fake_quant(dh, fmt, halves=-1)
    assert torch.equal(got, torch.cat([quant.fake_quant(dh[:, :I], fmt),
                                       quant.fake_quant(dh[:, I:], fmt)], -1))
    whole = torch.randn(256, 256, generator=g)
    assert torch.equal(quant.fake_quant(whole, fmt, True, halves=-2),
                       quant.fake_quant(whole, fmt, True))
    assert torch.equal(quant.fake_quant(whole, fmt, halves=-1), quant.fake_quant(whole, fmt))


@pytest.mark.parametrize("q", [128, 32])
def test_weight_cache_pads_each_part_to_whole_blocks(q):
    """The kernels' fp8 weights of widths not whole 128-blocks: W1 [L, 2I, D] laid out as
    [L * 2 PI, PD] (gate rows, zeros to PI, up rows, zeros), W2 [L, D, I] as [L * PD, PI];
    their quantization is the reference's of each part (zeros leave the partial blocks'
    scales), and the transposed copies are those of the padded weights."""
    from mokgen.runtime.weight_quant import WeightCache, pad_weight

    g = torch.Generator().manual_seed(8)
    L, D, I = 2, 208, 144
    PD, PI = 256, 256
    w1 = torch.randn(L, 2 * I, D, generator=g).bfloat16()
    w2 = torch.randn(L, D, I, generator=g).bfloat16()
    p1 = pad_weight(w1, True)
    assert p1.shape == (L, 2 * PI, PD)
    assert torch.equal(p1[:, :I, :D], w1[:, :I]) and torch.equal(p1[:, PI:PI + I, :D], w1[:, I:])
    assert p1[:, I:PI].abs().sum() == 0 and p1[:, :, D:].abs().sum() == 0
    assert pad_weight(torch.zeros(L, 256, 384), True).shape == (L, 256, 384)
    cache = WeightCache(q, slots=1)
    e, t = cache.get(w1, w2), cache.transposed(w1, w2)
    assert e.w1.shape == (L * 2 * PI, PD) and e.w2.shape == (L * PD, PI)
    assert t.w1.shape == (L * PD, 2 * PI) and t.w2.shape == (L * PI, PD)
    for data, scales, w, rows, halves in ((e.w1, e.s1, w1, 2 * PI, -2), (e.w2, e.s2, w2, PD, None)):
        deq = data.view(torch.float8_e4m3fn).float().view(L, rows, -1)
        if q == 128:
            deq = deq * scales.view(L, rows // 128, 1, -1, 1).repeat_interleave(
                128, 2).repeat_interleave(128, 4).view(L, rows, -1)
        else:
            deq = deq * scales.t().reshape(L, rows, -1).repeat_interleave(32, -1)
        fmt = "fp8" if q == 128 else "mxfp8"
        want = torch.stack([quant.fake_quant(w[i].float(), fmt, True, halves) for i in range(L)])
        if halves:
            deq = torch.cat([deq[:, :I, :D], deq[:, PI:PI + I, :D]], 1)
        else:
            deq = deq[:, :D, :I]
        assert torch.equal(deq, want)


def _special_weight(dtype):
    """Random normal rows at many magnitudes plus every special block the spec names."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 64, 128, generator=g) * torch.logspace(-30, 30, 8)[:, None, None]
    w[0, 0, :32] = 0.0                                 # all-zero block
    w[0, 1, :32] = -0.0
    w[0, 2, :32] = 3.0                                 # all equal
    w[0, 3, :32] = torch.tensor(2.0) ** torch.arange(-16, 16).float()  # powers of two
    w[0, 4, 5] = float("nan")                          # NaN block
    w[0, 5, 7] = float("inf")                          # Inf block
    w[0, 6, :32] = torch.randn(32, generator=g) * 1e-39  # fp32 subnormals (bf16 keeps some)
    w[0, 7, :32] = 448.0 * 1.9                         # saturation
    w[1, :, :] = w[1].sign() * torch.rand(64, 128, generator=g)  # ties at many roundings
    return w.to(dtype)


def _quantizers(fmt):
    """The weight quantizers an `fmt` layer's prologue carries (runtime/weight_quant.py
    launches them), from a layer of the fp8 GPU tests."""
    import mokgen

    layer = mokgen.compile(mokgen.shapes.get("gpu-small"), ep=1, dtype=fmt,
                           tokens_per_rank=1000, virtual=True)
    return layer.runtime().prologue.module


@pytest.mark.parametrize("fmt,entries", [
    ("fp8", ["mokgen_fp8w_bf16", "mokgen_fp8w_f32"]),
    ("mxfp8", ["mokgen_mx_rows_bf16", "mokgen_mx_cols_bf16", "mokgen_mx_rows_f32",
               "mokgen_mx_cols_f32"]),
    ("bf16", [])])
def test_prologue_carries_its_formats_weight_quantizers(fmt, entries):
    """What runtime/weight_quant.py launches is in the layer's prologue, and only in fp8 ones."""
    import mokgen
    from mokgen.compiler import codegen

    p = mokgen.plan(mokgen.shapes.get("gpu-small"), ep=1, dtype=fmt, tokens_per_rank=1000)
    (k,) = codegen.emit(p, units=("prologue",))
    found = sorted(set(re.findall(r"mokgen_(?:mx_(?:rows|cols)|fp8w)_\w+", k.source)))
    assert found == sorted(entries)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True])
def test_gpu_weight_quantization_is_bit_exact(dtype, transposed):
    w = _special_weight(dtype)
    d, s = weight_quant.mx(_quantizers("mxfp8"), w.cuda(), transposed=transposed)
    rd, rs = quant.quantize_weight(w, transposed=transposed)  # the torch reference, on CPU
    assert torch.equal(s.cpu(), rs), "scales differ"
    diff = (d.view(torch.uint8).cpu() != rd.view(torch.uint8)).sum().item()
    assert diff == 0, f"{diff} elements differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("transposed", [False, True])
def test_gpu_weight_quantization_of_partial_blocks_is_bit_exact(transposed):
    """Widths of 16 past whole blocks (MX: 1.5 blocks; blockwise: 1.125 x 1.625 blocks): the
    GPU entry points (which pad a copy with zeros) against the references."""
    w = _special_weight(torch.bfloat16)[:, :48, :80].contiguous()
    d, s = weight_quant.mx(_quantizers("mxfp8"), w.cuda(), transposed=transposed)
    rd, rs = quant.quantize_weight(w, transposed=transposed)
    assert torch.equal(s.cpu(), rs)
    assert torch.equal(d.view(torch.uint8).cpu(), rd.view(torch.uint8))
    wb = torch.randn(3, 144, 208).bfloat16()
    d, s = weight_quant.blockwise(_quantizers("fp8"), wb.cuda())
    rd, rs = quant.quantize_weight_blockwise(wb)
    assert s.shape == (3, 2, 2) and torch.equal(s.cpu(), rs)
    assert torch.equal(d.view(torch.uint8).cpu(), rd.view(torch.uint8))


# ---------------------------------------------------------------- DeepSeek-style blockwise fp8
def test_blockwise_scale_is_amax_over_448():
    t = torch.zeros(2, 256)
    t[0, :128] = torch.linspace(-896.0, 896.0, 128)   # amax 896 -> scale 2
    t[1, 128:] = 0.5                                   # amax 0.5 -> scale 0.5/448
    data, scales = quant.to_fp8_blockwise(t)
    assert scales.shape == (2, 2)
    assert scales[0, 0] == 2.0 and scales[0, 1] == 1.0 and scales[1, 0] == 1.0  # zero blocks: 1
    assert torch.isclose(scales[1, 1], torch.tensor(0.5 / 448))
    assert data[0, 0].float() == -448.0 and data[0, 127].float() == 448.0
    assert torch.all(data[1, 128:].float() == 448.0)
    assert torch.all(data[0, 128:].float() == 0) and torch.all(data[1, :128].float() == 0)
    back = quant.from_fp8_blockwise(data, scales)
    assert back[0, 0] == -896.0 and torch.allclose(back[1, 128:], torch.full((128,), 0.5))


def test_blockwise_weight_blocks_and_special_values():
    w = torch.randn(3, 256, 384)
    w[0, 0, 0] = float("nan")
    data, scales = quant.to_fp8_blockwise(w, quant.WEIGHT_BLOCK)
    assert scales.shape == (3, 2, 3)
    assert scales[0, 0, 0].isnan() and torch.isfinite(scales[0, 0, 1:]).all()
    back = quant.from_fp8_blockwise(data, scales, quant.WEIGHT_BLOCK)
    assert back[0, :128, :128].isnan().all() and torch.isfinite(back[0, 128:]).all()
    ok = torch.ones_like(w, dtype=torch.bool)
    ok[0, :128, :128] = False
    err = ((back - w)[ok].norm() / w[ok].norm()).item()
    assert err < 0.05  # e4m3 keeps 3 mantissa bits: ~2-3% relative
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        quant.to_fp8_blockwise(torch.randn(128), quant.WEIGHT_BLOCK)


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8"])
def test_quantized_reference_layer_is_close_to_the_exact_one(fmt):
    """The fp8 kernels' math contract: the layer with quantized routed operands stays within
    the design's 6e-2 of the exact layer on random normal inputs."""
    from mokgen import reference

    g = torch.Generator().manual_seed(0)
    N, E, D, I, k = 64, 8, 256, 256, 2
    x = torch.randn(N, D, generator=g)
    z = torch.randn(N, E, generator=g)
    w1 = torch.randn(E, 2 * I, D, generator=g) / D**0.5
    w2 = torch.randn(E, D, I, generator=g) / I**0.5
    sw1, sw2 = torch.randn(2 * I, D, generator=g) / D**0.5, torch.randn(D, I, generator=g) / I**0.5
    exact = reference.moe_forward(x, z, w1, w2, sw1, sw2, k)
    q = reference.moe_forward(x, z, w1, w2, sw1, sw2, k, fp8=fmt)
    err = ((q - exact).norm() / exact.norm()).item()
    assert 1e-3 < err <= 6e-2, err  # quantization does change the result, within the bound
    # the quantized expert is exactly the composition of fake-quantized GEMMs
    e0 = reference.expert_ffn_quantized(x[:4], w1[0], w2[0], fmt)
    g_, u = (quant.fake_quant(x[:4], fmt) @ quant.fake_quant(w1[0], fmt, weight=True).T).chunk(2, -1)
    want = quant.fake_quant(torch.nn.functional.silu(g_) * u, fmt) @ \
        quant.fake_quant(w2[0], fmt, weight=True).T
    assert torch.equal(e0, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_blockwise_weight_quantization_is_bit_exact(dtype):
    """The blockwise fp8 weight kernel against the torch reference (on CPU): random blocks
    at many magnitudes plus the special ones (zero, all equal, NaN, Inf, saturation)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(4, 256, 384, generator=g) * torch.logspace(-20, 20, 4)[:, None, None]
    w[0, :128, :128] = 0.0
    w[0, :128, 128:256] = 3.0
    w[0, 128:, :128] = torch.randn(128, 128, generator=g) * 1e-39
    w[1, 5, 7] = float("nan")
    w[1, 200, 300] = float("inf")
    w[2, :128, 256:] = w[2, :128, 256:].sign() * torch.rand(128, 128, generator=g)
    w = w.to(dtype)
    d, s = weight_quant.blockwise(_quantizers("fp8"), w.cuda())
    rd, rs = quant.quantize_weight_blockwise(w)
    assert torch.equal(s.cpu().isnan(), rs.isnan())
    assert torch.equal(s.cpu().nan_to_num(), rs.nan_to_num()), "scales differ"
    diff = (d.view(torch.uint8).cpu() != rd.view(torch.uint8)).sum().item()
    assert diff == 0, f"{diff} elements differ"


def test_weight_cache_requantizes_exactly_when_a_weight_changes():
    """The fp8 forward's weight cache: same tensor objects at the same version hit; an
    in-place update (optimizer step) or another tensor misses; one entry per hosted rank."""
    from mokgen.runtime.weight_quant import WeightCache

    cache, calls = WeightCache(128, slots=2), []
    cache.quantize = lambda w: (calls.append(w), (w, w))[1]
    a, b = torch.zeros(1, 128, 128), torch.zeros(1, 128, 128)  # whole blocks: quantized as they are
    cache.get(a, b)
    cache.get(a, b)
    assert len(calls) == 2
    with torch.no_grad():
        a.add_(1)  # bumps a._version
    cache.get(a, b)
    assert len(calls) == 4
    x, y = torch.zeros(1, 128, 128), torch.zeros(1, 128, 128)
    cache.get(x, y)
    cache.get(a, b)  # still one of the two newest entries
    assert len(calls) == 6


def test_weight_cache_is_dropped_before_any_optimizer_step():
    """Before any optimizer's step every entry is dropped (stale after it, whatever tensors
    it steps: FSDP2 steps shards; freed before the step's own peak); calls before a step
    (gradient accumulation, activation recomputation) keep hitting."""
    from mokgen.runtime.weight_quant import WeightCache

    cache, calls = WeightCache(128, slots=2), []
    cache.quantize = lambda w: (calls.append(w), (w, w))[1]
    mine = [torch.nn.Parameter(torch.randn(1, 128, 128)) for _ in range(2)]
    other = torch.nn.Parameter(torch.randn(3))
    cache.get(*mine)
    cache.get(*mine)  # a second micro-batch: a hit
    assert len(calls) == 2
    other.grad = torch.ones_like(other)
    torch.optim.SGD([other], lr=0.1).step()  # steps none of the layer's own tensors
    assert not cache._cache
    cache.get(*mine)
    assert len(calls) == 4


def test_weight_cache_sees_fsdp2s_new_weights_after_a_step(tmp_path):
    """FSDP2 (one gloo rank on CPU) all-gathers its stepped shards into the same unsharded
    parameter each forward and keeps its version counter: the identity and version stay, the
    values change. The forward after an optimizer step must quantize the new values (a cache
    keyed on identity and version alone served step 0's weights for the whole run)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from mokgen.runtime.weight_quant import WeightCache

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(11)
            self.w1 = torch.nn.Parameter(torch.randn(1, 256, 128, generator=g))
            self.w2 = torch.nn.Parameter(torch.randn(1, 128, 128, generator=g))
            self.cache, self.seen = WeightCache(128, slots=1), []

        def forward(self, x):
            q = self.cache.get(self.w1, self.w2)  # the unsharded parameters, as a layer sees
            self.seen.append((self.w1.detach().clone(), q.w1.clone()))
            return (x @ self.w1[0].T).sum() + self.w2.sum()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = Experts()
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(2, 128)).backward()
            opt.step()
            opt.zero_grad()
        (before, q_before), (after, q_after) = model.seen
        assert not torch.equal(before, after)  # the step changed the weights
        assert torch.equal(q_after, quant.to_fp8_blockwise(
            after[0], quant.WEIGHT_BLOCK)[0].view(torch.uint8))
        assert not torch.equal(q_before, q_after)
    finally:
        dist.destroy_process_group()


def test_weight_cache_entries_belong_to_their_cuda_graph_capture(monkeypatch):
    """The host decides once whether to quantize, so a capture must hold its own
    quantization: it never reads an eager entry (every replay after an optimizer step would
    multiply those stale weights), its forward and backward share one, and neither an eager
    call nor a later capture reads it. Stand-ins for CUDA weights and a capturing stream (the
    GPU twin: test_gpu_module's CUDA graph test, an optimizer step between replays)."""
    from types import SimpleNamespace

    from mokgen.runtime import cuda, weight_quant

    capture = [None]  # the id of the capture under way, None: eager
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capture[0] is not None)
    monkeypatch.setattr(cuda, "capture_id", lambda stream=None: capture[0])
    monkeypatch.setattr(weight_quant, "pad_weight", lambda w, halves: w)
    cache, quantized = weight_quant.WeightCache(128, slots=1), []
    cache.quantize = lambda w: (quantized.append(w), (object(), object()))[1]
    w1, w2 = (SimpleNamespace(is_cuda=True, is_meta=False, _version=0) for _ in range(2))

    def entry(capture_id):
        capture[0] = capture_id
        return cache.get(w1, w2)

    eager = entry(None)
    assert entry(None) is eager and len(quantized) == 2  # w1 and w2, once
    in_capture = entry(7)
    assert in_capture is not eager and len(quantized) == 4, "a capture read an eager entry"
    assert entry(7) is in_capture and len(quantized) == 4  # its backward: a hit
    assert entry(None) is not in_capture, "an eager call read a capture's entry"
    assert entry(8) is not in_capture, "a capture read another capture's entry"
    assert len(quantized) == 8


@pytest.mark.parametrize("q", [128, 32])
def test_weight_cache_transposed_copies_are_the_transposes_quantizations(q):
    """The fp8 backward's W^T: blockwise, the forward's 128 x 128 blocks transposed (the same
    values); MX, the weight quantized along its other dim. Bit for bit mokgen.quant of w^T,
    in the kernels' layouts ([L*cols, rows] data; blockwise scales [L*cols/128, rows/128], MX
    fp32 scales [rows/32, L*cols])."""
    from mokgen.runtime.weight_quant import WeightCache

    g = torch.Generator().manual_seed(3)
    L, rows, cols = 2, 256, 384
    w1 = torch.randn(L, rows, cols, generator=g).bfloat16()
    w2 = torch.randn(L, cols, rows, generator=g).bfloat16()
    t = WeightCache(q, slots=1).transposed(w1, w2)
    for w, data, scales in ((w1, t.w1, t.s1), (w2, t.w2, t.s2)):
        wt = w.transpose(1, 2).contiguous()
        if q == 128:
            want_q, want_s = quant.to_fp8_blockwise(wt, quant.WEIGHT_BLOCK)
            want_s = want_s.reshape(-1, want_s.shape[-1])
        else:
            want_q, e8 = quant.to_mxfp8(wt)
            want_s = torch.exp2(e8.float() - quant.SCALE_BIAS).reshape(-1, e8.shape[-1]).t()
        assert torch.equal(data, want_q.view(torch.uint8).reshape(data.shape))
        assert torch.equal(scales, want_s)


def test_weight_cache_frees_the_transposed_copy_after_one_backward_keeps_it_after_two():
    """backward_done (each backward call, once its kernel is enqueued): after the first
    backward on a weight version the transposed copy goes and the forward's stays; a second
    backward before any optimizer step (gradient accumulation) makes the same bits again and
    keeps them for the third; a new version (after clear: an optimizer step) starts over."""
    from mokgen.runtime.weight_quant import WeightCache

    g = torch.Generator().manual_seed(4)
    w1 = torch.randn(2, 256, 128, generator=g).bfloat16()
    w2 = torch.randn(2, 128, 128, generator=g).bfloat16()
    cache = WeightCache(128, slots=1)
    forward, first = cache.get(w1, w2), cache.transposed(w1, w2)
    cache.backward_done(w1, w2)
    assert not hasattr(forward, "t") and cache.get(w1, w2) is forward
    again = cache.transposed(w1, w2)
    assert again is not first
    for f in ("w1", "s1", "w2", "s2"):
        assert torch.equal(getattr(again, f), getattr(first, f))
    cache.backward_done(w1, w2)
    assert cache.transposed(w1, w2) is again  # accumulating: kept
    cache.clear()
    cache.backward_done(w1, w2)  # nothing cached: nothing to do
    cache.transposed(w1, w2)
    cache.backward_done(w1, w2)
    assert not hasattr(cache.get(w1, w2), "t")  # a new version: freed after its first
