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

from ..plan import Plan

MX_BLOCK = 32
FP8_BLOCK = 128
SCALE_BLOCK = {"fp8": FP8_BLOCK, "mxfp8": MX_BLOCK}


def precision(plan: Plan) -> Plan:
    d = plan.shape.hidden
    if plan.dtype == "bf16":
        return plan.replace(act_dtype="bf16", shared_dtype="bf16", quant_fused=(),
                            scale_block=0, row_bytes=2 * d)
    q = SCALE_BLOCK[plan.dtype]  # whole blocks along K: a rule of mokgen.limits
    weights = "per 32 along K" if q == MX_BLOCK else "per 128 x 128 block"
    return plan.replace(
        act_dtype=f"{plan.dtype}_e4m3", shared_dtype="bf16", scale_block=q,
        quant_fused=(f"weights: once per weight version, {weights}",
                     f"x: once by its owner before dispatch, per {q} along D",
                     f"swiglu output: in the gate/up epilogue, per {q} along I"),
        row_bytes=d + 4 * -(-d // q))  # e4m3 rows + fp32 scales travel
