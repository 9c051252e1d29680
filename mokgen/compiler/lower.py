"""Annotated task graph -> each kernel's template parameters, operator by operator.

Every op contributes the parameters its annotations decide: a comm op its launch's comm CTAs,
a compute op the rest, a GEMM op the tile engine's BM x BN x stages and consumer schedule, an
op on the ring the minibatch and ring rows, an op touching e4m3 data the scale block, the
schedule the tile its expert regions are padded to, a comm op that moves nothing (gathered
rows, dx rows in the ring) the flag of that kernel variant. A kernel instantiates each
parameter once, so two of its ops asking for different values is a plan it cannot run:
ValueError naming both.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from mokgen.compiler import ir
from mokgen.compiler.ir import OpKind
from mokgen.compiler.limits import GATHER, RING, x_window_slots

if TYPE_CHECKING:
    from mokgen.compiler.plan import Plan

# annotation -> template parameter it sets
_PARAMS = {"gemm": "gemm", "minibatch": "minibatch", "ring_rows": "ring_rows",
           "scale_block": "scale_block", "pad_rows": "block_m", "x_slots": "x_slots"}


def op_params(op: ir.Op) -> dict:
    """The template parameters one annotated op decides."""
    a = dict(op.attrs)
    out = {p: a[k] for k, p in _PARAMS.items() if k in a}
    if "sm_role" in a:
        out["comm_sms" if a["sm_role"] == "comm" else "compute_ctas"] = a["ctas"]
    if "gemm" in a:
        out["block_m"] = a["gemm"].bm
    if a.get("comm_direction") == GATHER:  # no copy: the GEMMs read the rows in place
        out["gather"] = True
    if a.get("comm_direction") == RING:  # dx rows over their dy rows (passes/dx_rows.py)
        out["dx_ring"] = True
    return out


# The epilogues' staging (GemmCfg EPI_BYTES), in bf16 kernels (fp8's stages hold scales):
# the backward's weight-gradient boxes (gemm_epilogue.cuh store_rows_tma: 8 KB each, two a
# consumer warpgroup) and the forward's routed down rows (moe_fwd.cuh kWarpStage: 4 KB for
# each of 8 consumer warps, which it asserts): 32 KB either way.
EPI_STAGE_BYTES = 32 * 1024


def engine_bytes(gemm: ir.GemmConfig) -> int:
    """GemmCfg's ENGINE_BYTES (gemm_types.cuh; bf16, 4 task slots): the stages, their and the
    task slots' barriers, the slots, PAIR's mailbox and the scheduler's `taken` barrier. The
    one mirror of that layout on the host."""
    slots, mail_slots = 4, 4
    return gemm.stages * (gemm.bm + gemm.bn) * 64 * 2 + 8 * (2 * gemm.stages + 2 * slots) \
        + 32 * slots + (mail_slots * 20 if gemm.pair else 0) + 8


def smem_bytes(gemm: ir.GemmConfig) -> int:
    """GemmCfg's SMEM_BYTES with no epilogue staging (EPI_BYTES 0): the dynamic shared memory
    the engine's standalone kernels are launched with (gemm_test.cu, which asserts its
    configurations' sizes)."""
    return 1024 + engine_bytes(gemm)


def stage_bytes(gemm: ir.GemmConfig, smem: int = 227 * 1024) -> int:
    """EPI_STAGE_BYTES where the stages leave room for it, else 0 (register stores): the
    GemmCfg's total, which its SMEM_BYTES static_assert checks against 227 KB."""
    room = smem - 1024 - -(-engine_bytes(gemm) // 1024) * 1024
    return EPI_STAGE_BYTES if EPI_STAGE_BYTES <= room else 0


def lower(g, direction: str) -> dict:
    """The parameters of the `direction` ("fwd" or "bwd") kernels: the forward's also
    instantiate the prologue (routing, schedule), whose ops are forward ops."""
    got, who = {}, {}
    for op in ir.ops(g, direction):
        for k, v in op_params(op).items():
            if got.setdefault(k, v) != v:
                raise ValueError(f"{op.name} needs {k}={v} but {who[k]} needs {got[k]}: the "
                                 f"{direction} kernel instantiates one {k}")
            who.setdefault(k, op.name)
    gemm = got["gemm"]
    return dict(comm_sms=got["comm_sms"], num_sms=got["comm_sms"] + got["compute_ctas"],
                gemm_bn=gemm.bn, gemm_stages=gemm.stages, gemm_pair=gemm.pair,
                # bf16 kernels' epilogue staging: the backward's whole-expert weight-gradient
                # tiles leave through shared memory and TMA stores (moe_bwd.cuh kTmaWgrad),
                # the forward's routed down rows through shared memory (moe_fwd.cuh
                # kStagedRows: 4 KB a consumer warp)
                epi_stage_bytes=0 if got.get("scale_block") else stage_bytes(gemm),
                block_m=got["block_m"], minibatch=got["minibatch"],
                ring_slots=got["ring_rows"] // got["minibatch"],
                scale_block=got.get("scale_block", 0),
                # dispatch (forward) / reverse-combine (backward) "gather": FwdConsts GATHER
                gather=got.get("gather", False),
                # reverse-dispatch "ring" (backward): FwdConsts DXRING
                dx_ring=got.get("dx_ring", False),
                # a backward that copies rows and finds no x in the ring, after a forward
                # that gathered or a call that kept its own h (keep_h): FwdConsts XPULL
                x_pull=direction == "bwd" and not got.get("gather") and (
                    _forward_gathers(g) or _keeps_h(g)),
                # its x ring a window smaller than the ring (passes/x_window.py): FwdConsts
                # XSLOTS (0: the ring's, the source as without the pass)
                x_slots=x_window_slots(got.get("x_slots"), got["ring_rows"] // got["minibatch"]))


def _forward_gathers(g) -> bool:
    """Whether the forward's dispatch gathers x in its GEMMs (its ring then holds no x)."""
    return any(op.comm == "dispatch" and op.attr("comm_direction") == GATHER
               for op in ir.comm_ops(g))


def _keeps_h(g) -> bool:
    """Whether each call keeps its own h (passes/keep_h.py): the ring's x rows are then the
    last call's, not the differentiated one's."""
    return bool(ir.op_of(g, OpKind.GATE_UP_GEMM).attr("keep_h", False))


def problem_params(g) -> dict:
    """What the layer fixes (the shape and the ranks), for every kernel."""
    d = g.graph["dims"]
    return dict(num_experts=d["E"], topk=d["k"], local_experts=d["L"], hidden=d["D"],
                intermediate=d["I"], shared_dim=d["I_s"], ep=d["R"])

def layer_spec(plan: Plan):
    """The runtime's view of a plan: plain sizes (the runtime knows no plans)."""
    from mokgen.runtime.workspace import LayerSpec

    p, s = plan, plan.shape
    return LayerSpec(s.num_experts, s.hidden, s.intermediate, s.shared_dim, s.topk, p.ep,
                     p.tokens_per_rank, p.block_m, p.minibatch, p.macrobatch, p.comm_sms_fwd,
                     p.max_routed_rows, p.comm_sms_bwd, p.scale_block, p.gemm_bwd.bn,
                     p.dispatch, p.combine, p.reverse_combine, p.reverse_dispatch,
                     x_window_slots(p.x_slots, p.ring_slots), p.keep_h)
