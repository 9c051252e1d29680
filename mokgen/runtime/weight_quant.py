"""fp8 weight quantization on the GPU: launches of the quantizer entries every fp8 layer's
prologue module carries (compiler/templates/weight_quant.j2 over mokgen/quant.cuh and
mokgen/fp8.cuh), so quantizing a weight at run time compiles nothing. Bit for bit
mokgen.quant's references: `mx` as quant.quantize_weight, `blockwise` as
quant.quantize_weight_blockwise (tests/test_quant.py); a dim that is not whole blocks runs on
a copy zero-padded to whole blocks (zeros leave a partial block's scale as it is)."""
from __future__ import annotations

import torch

from mokgen import quant
from mokgen.runtime import cuda


def _suffix(w: torch.Tensor) -> str:
    quant.check_weight(w)
    return "bf16" if w.dtype == torch.bfloat16 else "f32"


def mx(module, w: torch.Tensor, transposed: bool = False):
    """MXFP8 of a CUDA weight [..., rows, cols], blocks along cols, or with `transposed` along
    rows, returned as [..., cols, rows]: (e4m3 data, uint8 e8m0 scales). `module`: a loaded
    prologue of an mxfp8 plan."""
    sfx = _suffix(w)
    rows, cols = w.shape[-2], w.shape[-1]
    k = rows if transposed else cols
    if k % quant.BLOCK:
        data, scales = mx(module, quant.pad_to(w, -2 if transposed else -1, quant.BLOCK),
                          transposed)
        return data[..., :k], scales
    w = w.contiguous()
    batch = w.numel() // (rows * cols)
    out_shape = (*w.shape[:-2], cols, rows) if transposed else tuple(w.shape)
    data = torch.empty(out_shape, dtype=torch.uint8, device=w.device)
    scales = torch.empty((*out_shape[:-1], out_shape[-1] // quant.BLOCK), dtype=torch.uint8,
                         device=w.device)
    f = module.function(f"mokgen_mx_{'cols' if transposed else 'rows'}_{sfx}")
    blocks = rows * cols // quant.BLOCK
    cuda.launch(f, (max(1, min(4096, -(-blocks // 256))), batch), 256, 0, None,
                [w, rows, cols, data, scales])
    return data.view(torch.float8_e4m3fn), scales


def blockwise(module, w: torch.Tensor):
    """Blockwise fp8 of a CUDA weight [..., rows, cols], 128 x 128 blocks over the last two
    dims: (e4m3 data, fp32 scales [..., ceil(rows/128), ceil(cols/128)]). `module`: a loaded
    prologue of an fp8 plan."""
    sfx = _suffix(w)
    rows, cols = w.shape[-2], w.shape[-1]
    br, bc = quant.WEIGHT_BLOCK
    if rows % br or cols % bc:
        data, scales = blockwise(module, quant.pad_to(quant.pad_to(w, -2, br), -1, bc))
        return data[..., :rows, :cols], scales
    w = w.contiguous()
    batch = w.numel() // (rows * cols)
    data = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    scales = torch.empty((*w.shape[:-2], rows // br, cols // bc), dtype=torch.float32,
                         device=w.device)
    f = module.function(f"mokgen_fp8w_{sfx}")
    cuda.launch(f, (max(1, min(4096, rows * cols // (br * bc))), batch), 256, 0, None,
                [w, rows, cols, data, scales])
    return data.view(torch.float8_e4m3fn), scales
