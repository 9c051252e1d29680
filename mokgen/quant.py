"""MXFP8 (OCP Microscaling v1.0) quantization: the reference the fp8 kernels must match.

A block is 32 consecutive elements along `dim`. Its shared scale is X = 2^(floor(log2(amax))
- 8), 8 being the largest exponent of e4m3 (max normal 448 = 1.75 * 2^8), stored as an e8m0
biased exponent (uint8, bias 127; 255 means NaN). Elements are V / X rounded to nearest even
in float8_e4m3fn, saturated to +-448 (V / X can reach 2^9 > 448). Subnormal e4m3 results
(down to 2^-9) are kept. An all-zero block gets the smallest scale (byte 0) and zeros; a block
holding NaN or +-Inf gets the NaN scale (255) and dequantizes to NaN.
A dim that is not a multiple of the block ends in a partial block, quantized as if padded with
zeros (its amax is over its elements: the zeros leave its scale unchanged); the scales then
have ceil(size / block) entries along it. The kernels do the same (TMA zero-fills the K tail).
"""
from __future__ import annotations

import torch

BLOCK = 32
E4M3_MAX = 448.0
E4M3_EMAX = 8
SCALE_BIAS, SCALE_NAN = 127, 255


def pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """t with zeros appended along dim up to a multiple of `multiple` (t itself if none)."""
    extra = -t.shape[dim] % multiple
    if not extra:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim)


def _blocks(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t's dim split into blocks of 32 (a partial last block padded with zeros)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    moved = pad_to(t.movedim(dim % t.dim(), -1), -1, BLOCK)
    return moved.reshape(*moved.shape[:-1], moved.shape[-1] // BLOCK, BLOCK)


def _unblock(b: torch.Tensor, dim: int, ndim: int, size: int | None = None) -> torch.Tensor:
    """Inverse of _blocks; `size`: the dim's size before padding (its padding dropped)."""
    flat = b.reshape(*b.shape[:-2], -1)
    if size is not None:
        flat = flat[..., :size]
    return flat.movedim(-1, dim % ndim)


def to_mxfp8(t: torch.Tensor, dim: int = -1):
    """-> (data float8_e4m3fn like t, scales uint8 with t's shape but ceil(size/32) along dim)."""
    x = _blocks(t, dim).float()
    amax = x.abs().amax(-1, keepdim=True)
    finite = torch.isfinite(amax)
    # floor(log2(amax)) exactly: amax = m * 2^e with m in [0.5, 1)
    exp = torch.frexp(torch.where(finite & (amax > 0), amax, torch.ones_like(amax)))[1] - 1
    biased = (exp - E4M3_EMAX + SCALE_BIAS).clamp(0, 254)
    biased = torch.where(amax > 0, biased, torch.zeros_like(biased))
    biased = torch.where(finite, biased, torch.full_like(biased, SCALE_NAN))
    scale = torch.exp2((biased.clamp(max=254) - SCALE_BIAS).float())
    q = (x / scale).clamp(-E4M3_MAX, E4M3_MAX)
    q = torch.where(finite, q, torch.full_like(q, float("nan")))
    data = q.to(torch.float8_e4m3fn)  # round to nearest even, subnormals kept
    return (_unblock(data, dim, t.dim(), t.shape[dim]),
            _unblock(biased.to(torch.uint8), dim, t.dim()))


def from_mxfp8(data: torch.Tensor, scales: torch.Tensor, dim: int = -1,
               dtype=torch.float32) -> torch.Tensor:
    """Dequantize: element * 2^(scale - 127); the NaN scale gives NaN."""
    if data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"data must be torch.float8_e4m3fn, got {data.dtype}")
    if scales.dtype != torch.uint8:
        raise TypeError(f"scales must be uint8 (e8m0 biased exponents), got {scales.dtype}")
    d = _blocks(data.float(), dim)
    s = scales.movedim(dim % scales.dim(), -1).unsqueeze(-1).int()
    if s.shape[:-1] != d.shape[:-1]:
        raise ValueError(f"scales must have shape {tuple(_unblock(d[..., :1], dim, data.dim()).shape)}"
                         f", got {tuple(scales.shape)}")
    factor = torch.where(s == SCALE_NAN, torch.full_like(s, 0, dtype=torch.float32) * float("nan"),
                         torch.exp2((s - SCALE_BIAS).float()))
    return _unblock(d * factor, dim, data.dim(), data.shape[dim]).to(dtype)


# ---------------------------------------------------------------- DeepSeek-style blockwise fp8
# The format Hopper users train with: e4m3 elements, one fp32 scale per block, scale =
# amax / 448 (not a power of two): 1 x 128 blocks for activations, 128 x 128 for weights,
# over the last two dims. Elements are x * (448 / amax), the block's inverse scale computed
# once (one IEEE division per block, as DeepSeek's casts do: a kernel multiplies, it does not
# divide every element), clamped to the largest float for blocks so small (amax < ~1.3e-36)
# that it would overflow. All fp32, every division an element-wise IEEE one (torch turns a
# division by a Python number into a multiplication by its reciprocal on CUDA, so none is
# used). An all-zero block gets scale 1 and zeros; a block holding NaN or Inf gets a NaN
# scale and NaN elements. Partial blocks (a size not a multiple of the block) are quantized as
# if padded with zeros, like MX's: scales [..., ceil(R/br), ceil(C/bc)].
ACT_BLOCK, WEIGHT_BLOCK = (1, 128), (128, 128)


def _tiles(t: torch.Tensor, block) -> torch.Tensor:
    """[..., R, C] -> [..., ceil(R/br), ceil(C/bc), br, bc], partial blocks padded with zeros
    (a view-free copy is fine: references only)."""
    if t.dim() < 2:
        raise ValueError("blockwise fp8 needs at least 2 dimensions")
    br, bc = block
    t = pad_to(pad_to(t, -2, br), -1, bc)
    R, C = t.shape[-2], t.shape[-1]
    x = t.reshape(*t.shape[:-2], R // br, br, C // bc, bc)
    return x.transpose(-3, -2)


def _untile(x: torch.Tensor, shape) -> torch.Tensor:
    """Inverse of _tiles for a tensor whose last two dims were `shape` (padding dropped)."""
    x = x.transpose(-3, -2)
    x = x.reshape(*x.shape[:-4], x.shape[-4] * x.shape[-3], x.shape[-2] * x.shape[-1])
    return x[..., :shape[-2], :shape[-1]]


def to_fp8_blockwise(t: torch.Tensor, block=ACT_BLOCK):
    """-> (data float8_e4m3fn like t, scales fp32 [..., ceil(R/br), ceil(C/bc)])."""
    x = _tiles(t.float(), block)
    amax = x.abs().amax((-2, -1), keepdim=True)
    top = torch.full_like(amax, E4M3_MAX)
    live = amax > 0
    scale = torch.where(live, amax / top, torch.ones_like(amax))
    inv = torch.where(live, top / torch.where(live, amax, top), torch.ones_like(amax))
    inv = inv.clamp(max=torch.finfo(torch.float32).max)  # blocks below ~1.3e-36: finite
    finite = torch.isfinite(amax)
    scale = torch.where(finite, scale, torch.full_like(amax, float("nan")))
    q = torch.where(finite, (x * inv).clamp(-E4M3_MAX, E4M3_MAX), torch.full_like(x, float("nan")))
    return _untile(q.to(torch.float8_e4m3fn), t.shape[-2:]), scale[..., 0, 0]


def from_fp8_blockwise(data: torch.Tensor, scales: torch.Tensor, block=ACT_BLOCK,
                       dtype=torch.float32) -> torch.Tensor:
    x = _tiles(data.float(), block)
    return _untile(x * scales[..., None, None], data.shape[-2:]).to(dtype)


def fake_quant(t: torch.Tensor, fmt: str, weight: bool = False,
               halves: int | None = None) -> torch.Tensor:
    """The values a kernel multiplies after quantizing `t` along its last dim (its K):
    fmt "mxfp8" (OCP MX, 32-element blocks) or "fp8" (blockwise: 1 x 128 for activations,
    128 x 128 for weights), dequantized to fp32. Any strides (a transposed weight is
    quantized along its new last dim). `halves` (-1 or -2): that dim is two parts, gate then
    up (W1's rows, dh's and W1^T's 2I columns), which the kernels block separately, each
    as if zero-padded to whole blocks (the same as one pass when a part is whole blocks)."""
    if halves is not None:
        gate, up = t.chunk(2, dim=halves)
        return torch.cat([fake_quant(gate, fmt, weight), fake_quant(up, fmt, weight)], halves)
    t = t.contiguous()
    if fmt == "mxfp8":
        return from_mxfp8(*to_mxfp8(t))
    if fmt == "fp8":
        block = WEIGHT_BLOCK if weight else ACT_BLOCK
        return from_fp8_blockwise(*to_fp8_blockwise(t, block), block)
    raise ValueError(f"unknown fp8 format {fmt!r}: expected 'mxfp8' or 'fp8'")


# ------------------------------------------------ weights in the kernels' layouts (references)
def check_weight(w) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() < 2:
        raise TypeError("w must be a torch.Tensor with at least 2 dimensions")
    if w.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"w must be bfloat16 or float32, got {w.dtype}")


def quantize_weight(w: torch.Tensor, transposed: bool = False):
    """MXFP8 of a weight [..., rows, cols] with blocks along its last dim (the forward's K), or
    with `transposed` along rows, returned in the transposed layout [..., cols, rows] (the
    backward's K): `to_mxfp8(w)` / `to_mxfp8(w.transpose(-1, -2).contiguous())`, a partial last
    block included. The GPU's bit-exact twin: mokgen.runtime.weight_quant.mx."""
    check_weight(w)
    return to_mxfp8(w.transpose(-1, -2).contiguous() if transposed else w)


def quantize_weight_blockwise(w: torch.Tensor):
    """Blockwise fp8 of a weight [..., rows, cols] (128 x 128 blocks over the last two dims):
    `to_fp8_blockwise(w, WEIGHT_BLOCK)`, partial blocks included. The GPU's bit-exact twin:
    mokgen.runtime.weight_quant.blockwise."""
    check_weight(w)
    return to_fp8_blockwise(w, WEIGHT_BLOCK)
