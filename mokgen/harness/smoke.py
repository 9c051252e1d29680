"""One checked call of a compiled layer on the visible GPU (the CLI's `compile --run`)."""
from __future__ import annotations

import torch

from mokgen.compiler.lower import layer_spec
from mokgen.compiler.plan import Plan
from mokgen.harness.workloads import make_inputs, reference_outputs, rel_error
from mokgen.runtime.workspace import workspace_bytes


# the forward's relative error against the fp32 reference (of the same quantization, fp8)
# that the GPU tests hold every layer to
TOLERANCE = 1e-2


def footprint(plan: Plan, tokens: int) -> int:
    """Device bytes the check holds at once, about: every virtual rank's inputs (make_inputs:
    x in bf16, router logits in fp32) and outputs, every expert's bf16 weights (the ranks
    together hold all of them), each rank's workspace for a forward (peer and forward parts;
    a little over: virtual ranks stage nothing), and the fp32 reference's outputs."""
    s, R = plan.shape, plan.ep
    weights = s.num_experts * 3 * s.hidden * s.intermediate * 2 + \
        (3 * s.shared_dim * s.hidden * 2 if s.shared_experts else 0)
    rows = R * tokens * (s.hidden * (2 + 2 + 4) + s.num_experts * 4)  # x, y, reference; logits
    ws = workspace_bytes(layer_spec(plan))
    return weights + rows + R * (ws["peer"] + ws["forward"])


def run_once(layer, tokens: int = 256) -> tuple[str, bool]:
    """All `ep` virtual ranks with `tokens` each (kept small: the fp32 reference of every
    rank must fit beside the layer), checked against the reference and timed once.
    -> (what happened, whether the error is within TOLERANCE; True where no GPU ran it,
    False where the check would not fit the GPU's free memory: nothing ran)."""
    if not torch.cuda.is_available():
        return "no GPU visible: compiled only", True
    plan = layer.plan
    n = min(tokens, plan.tokens_per_rank)
    need, free = footprint(plan, n), torch.cuda.mem_get_info()[0]
    if need > free:  # one GPU holds all ep ranks: refuse before an out-of-memory error
        return (f"not run: {plan.ep} virtual ranks x {n} tokens need about "
                f"{need / 2**30:.1f} GiB on this GPU (every expert's weights and {plan.ep} "
                f"workspaces), {free / 2**30:.1f} GiB are free: check a smaller --ep"), False
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
