"""Where data changes precision. bf16: nowhere. mxfp8 (OCP MX: e4m3 + one e8m0 scale per 32
elements along K): weights are quantized once ahead; activations are quantized where they
are produced (on dispatch pull and in the SwiGLU epilogue) so no extra pass over HBM happens.
The shared expert stays bf16 for training stability (paper 3.4)."""
from __future__ import annotations

from ..plan import Plan

MX_BLOCK = 32


def precision(plan: Plan) -> Plan:
    d = plan.shape.hidden
    if plan.dtype == "bf16":
        return plan.replace(act_dtype="bf16", shared_dtype="bf16", quant_fused=(),
                            row_bytes=2 * d)
    if d % MX_BLOCK or plan.shape.intermediate % MX_BLOCK:
        raise ValueError(f"mxfp8 needs hidden and intermediate to be multiples of {MX_BLOCK}, "
                         f"got hidden={d}, intermediate={plan.shape.intermediate}")
    return plan.replace(
        act_dtype="mxfp8_e4m3", shared_dtype="bf16",
        quant_fused=("weights: offline, per 32 along K",
                     "x: on dispatch (source rank quantizes once, peers pull fp8 + scales)",
                     "swiglu output: in the gate/up epilogue",
                     "dy: on reverse-combine"),
        row_bytes=d + d // MX_BLOCK)
