"""One checked call of a compiled layer on the visible GPU (the CLI's `compile --run`)."""
from __future__ import annotations

import torch

from mokgen.harness.workloads import make_inputs, reference_outputs, rel_error


# the forward's relative error against the fp32 reference (of the same quantization, fp8)
# that the GPU tests hold every layer to
TOLERANCE = 1e-2


def run_once(layer, tokens: int = 256) -> tuple[str, bool]:
    """All `ep` virtual ranks with `tokens` each (kept small: the fp32 reference of every
    rank must fit beside the layer), checked against the reference and timed once.
    -> (what happened, whether the error is within TOLERANCE; True where no GPU ran it)."""
    if not torch.cuda.is_available():
        return "no GPU visible: compiled only", True
    plan = layer.plan
    n = min(tokens, plan.tokens_per_rank)
    inputs = make_inputs(plan.shape, plan.ep, n)
    layer.runtime().poison()
    ys = layer(**inputs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    layer(**inputs)
    end.record()
    torch.cuda.synchronize()
    fp8 = None if plan.dtype == "bf16" else plan.dtype  # same-quantization reference
    ref = reference_outputs(plan.shape, inputs, fp8=fp8)
    err = max(rel_error(y, r) for y, r in zip(ys, ref))
    vs = "the reference" if fp8 is None else f"the {fp8} reference (same quantization)"
    ok = err <= TOLERANCE  # False for NaN too
    return (f"ran {plan.ep} virtual ranks x {n} tokens on {torch.cuda.get_device_name()}: "
            f"max rel. error vs {vs} {err:.2e} ({'ok' if ok else 'FAILED'}: at most "
            f"{TOLERANCE:.0e}), all ranks {start.elapsed_time(end):.3f} ms"), ok
