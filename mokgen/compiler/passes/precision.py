"""Where data changes precision. bf16: nowhere. The two fp8 formats (mokgen.quant) put e4m3
operands into the routed experts' GEMMs, with one scale per `scale_block` elements along K:
  mxfp8  OCP MX: e8m0 scales per 32 (the kernel promotes its fp32 sum every 32-wide K step);
  fp8    DeepSeek-style blockwise: fp32 scales per 1 x 128 (activations) and 128 x 128
         (weights): one promotion per 128-wide K slice, the format Hopper trains with.
Weights are quantized once per weight version, ahead of the kernel. Activations are quantized
where they are produced: each token once by its owner before dispatch (peers pull e4m3 rows
and their scales: half the bytes) and the SwiGLU output in the gate/up epilogue (straight
from the fp32 accumulators). The shared expert
stays bf16 for training stability (paper 3.4)."""
from __future__ import annotations

from mokgen.compiler import ir
from mokgen.compiler.ir import OpKind

MX_BLOCK = 32
FP8_BLOCK = 128
SCALE_BLOCK = {"fp8": FP8_BLOCK, "mxfp8": MX_BLOCK}
# The routed experts' GEMMs that read e4m3 operands in an fp8 plan. The weight gradients
# read the bf16 rings (the forward keeps x and a in bf16 for them).
ROUTED_GEMMS = (OpKind.GATE_UP_GEMM, OpKind.DOWN_GEMM, OpKind.REPLAY, OpKind.DOWN_DGRAD,
                OpKind.GATE_UP_DGRAD)


def precision(g):
    """Annotates the GEMM ops with the `precision` they read, the ops that touch e4m3 data
    with the `scale_block` (elements per scale along K, 0 for bf16), where activations and
    weights are quantized (`quantize`), and the dispatch with the `row_bytes` a row moves."""
    dtype, d = g.graph["problem"]["dtype"], g.graph["dims"]["D"]
    q = SCALE_BLOCK.get(dtype, 0)  # whole blocks along K: a rule of mokgen.compiler.limits
    weights = "per 32 along K" if q == MX_BLOCK else "per 128 x 128 block"
    quantize = {OpKind.DISPATCH: f"x: once by its owner before dispatch, per {q} along D",
                OpKind.GATE_UP_GEMM: f"weights: once per weight version, {weights}",
                OpKind.DOWN_GEMM: f"weights: once per weight version, {weights}",
                OpKind.SWIGLU: f"swiglu output: in the gate/up epilogue, per {q} along I"}
    changes = {}
    for op in ir.ops(g):
        a = changes[op.name] = {}
        if op.attr("gemms"):
            a["precision"] = f"{dtype}_e4m3" if q and op.kind in ROUTED_GEMMS else "bf16"
        if op.kind in ROUTED_GEMMS or op.kind in quantize:
            a["scale_block"] = q
        if q and op.kind in quantize:
            a["quantize"] = quantize[op.kind]
        if op.kind is OpKind.DISPATCH:  # e4m3 rows + their fp32 scales travel
            a["row_bytes"] = d + 4 * -(-d // q) if q else 2 * d
    return ir.annotate(g, changes)
