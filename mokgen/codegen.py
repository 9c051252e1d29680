"""Plan -> CUDA C++ source. Templates only instantiate device headers with the plan's
constants (StrictUndefined: a missing name is an error, never an empty string)."""
from __future__ import annotations

from pathlib import Path

import jinja2

from .build import Kernel
from .config import CONFIG
from .plan import Plan

TEMPLATES = Path(__file__).parent / "templates"
_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES),
                          undefined=jinja2.StrictUndefined, keep_trailing_newline=True)

# Kernels each plan needs; name -> template. The name is the cache folder's prefix too.
UNITS = {"prologue": "prologue.cu.j2", "fwd": "fwd.cu.j2", "bwd": "bwd.cu.j2"}


def constants(plan: Plan) -> dict:
    s = plan.shape
    return dict(plan_key=plan.key(), num_experts=s.num_experts, topk=s.topk,
                local_experts=plan.local_experts, hidden=s.hidden, intermediate=s.intermediate,
                shared_dim=s.shared_dim, block_m=plan.block_m, minibatch=plan.minibatch,
                macrobatch=plan.macrobatch, ring_slots=plan.ring_slots, ep=plan.ep,
                comm_sms=plan.comm_sms_fwd, comm_sms_bwd=plan.comm_sms_bwd,
                num_sms=plan.num_sms, scale_block=plan.scale_block)


def check_supported(plan: Plan) -> None:
    """What the Hopper kernels implement today; say so instead of emitting wrong code."""
    if (plan.dispatch, plan.combine) != ("pull", "push"):
        raise ValueError("the forward kernel implements dispatch='pull', combine='push' only, "
                         f"got dispatch={plan.dispatch!r}, combine={plan.combine!r}")
    s = plan.shape
    # Any width is tiled: a width that is not a multiple of its tile ends in an edge tile
    # whose columns (rows) past it are dropped, and TMA zero-fills K tails (gemm_tile.cuh
    # cols_valid). 8: rows move as 16-byte vectors and TMA strides are multiples of 16 bytes.
    # fp8 (the routed experts' e4m3 tiles; the shared expert stays bf16): 128, the K slice
    # and the blockwise weight block (a partial block would need a padded scale layout).
    widths = (("hidden", s.hidden), ("intermediate", s.intermediate),
              ("shared_intermediate", s.shared_dim))
    for name, v in widths:
        if v % 8:
            raise ValueError(f"{name} must be a multiple of 8 for the sm_90a kernels, got {v}")
    for name, v in widths[:2] if plan.scale_block else ():
        if v % 128:
            raise ValueError(f"{name} must be a multiple of 128 for the {plan.dtype} kernels, "
                             f"got {v}")


def backward_unsupported(plan: Plan) -> str | None:
    """Why the backward kernel can't be built for this plan (None: it can). The forward
    still works for such shapes. Today: none beyond check_supported's."""
    return None


def emit(plan: Plan, units=tuple(UNITS)) -> list[Kernel]:
    check_supported(plan)
    if backward_unsupported(plan):
        units = tuple(u for u in units if u != "bwd")
    consts = constants(plan)
    flags = ("-DMOKGEN_DEBUG",) if CONFIG.debug else ()
    kernels = [Kernel(f"{u}_{plan.key()}", _ENV.get_template(UNITS[u]).render(**consts), flags)
               for u in units]
    if CONFIG.dump:
        CONFIG.dump.mkdir(parents=True, exist_ok=True)
        (CONFIG.dump / f"plan_{plan.key()}.json").write_text(plan.to_json())
        for k in kernels:
            (CONFIG.dump / f"{k.name}.cu").write_text(k.source)
    return kernels
