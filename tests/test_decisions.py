"""Every decision of a plan reaches the generated source, or the plan is refused (CPU).

One golden case per overridable field: flip it and the rendered kernels change (the units
that instantiate it, and only those), or mokgen refuses the plan with a ValueError. Then the
per-operator side: codegen lowers each op's annotations, and ops of one kernel that disagree
on what the kernel instantiates once are refused."""
import dataclasses

import pytest

import mokgen
from mokgen.compiler import codegen, ir, limits
from mokgen.compiler.lower import layer_spec
from mokgen.compiler.ir import GemmConfig, OpKind
from mokgen.compiler.lower import lower, op_params
from mokgen.compiler.plan import OVERRIDABLE, Plan
from mokgen.runtime.workspace import backward_tiles

SHAPE = mokgen.shapes.get("gpu-small")
ARGS = dict(ep=2, tokens_per_rank=1024)
ALL = {"prologue", "fwd", "bwd"}


def sources(plan) -> dict:
    """unit -> source, the plan key (in the first comment line only) taken out: forcing a
    field to any value changes the key, not necessarily the kernel."""
    out = {}
    for k in codegen.emit(plan):
        assert k.source.count(plan.key()) == 1
        out[k.name.split("_")[0]] = k.source.replace(plan.key(), "<key>")
    return out


# A minibatch small enough that the ring has slots a smaller budget can take away (the
# planner's own choice may already be the 2-slot minimum).
BASE = mokgen.plan(SHAPE, **ARGS, minibatch=512)
# field -> (a value other than the planner's, units whose source changes, or the refusal)
FLIPS = {
    # the paper's directions only; rows that do not move need one rank (their source
    # changes: tests/test_memory.py, tests/test_codegen.py)
    "dispatch": ("gather", "dispatch='gather' needs ep == 1"),
    "combine": ("pull", "combine must be one of"),
    "reverse_combine": ("push", "reverse_combine must be one of"),
    "reverse_dispatch": ("ring", "reverse_dispatch='ring' needs ep == 1"),
    "comm_sms_fwd": (BASE.comm_sms_fwd + 1, {"fwd"}),
    "comm_sms_bwd": (BASE.comm_sms_bwd + 1, {"bwd"}),
    "minibatch": (256, ALL),
    "macrobatch": (BASE.macrobatch + BASE.minibatch, ALL),  # one more ring slot
    "ring_budget_bytes": (2 * BASE.minibatch * 6 * SHAPE.hidden, ALL),  # a 2-slot ring
    # one rank whose forward gathers x only (its source change: tests/test_memory.py)
    "x_slots": (4, "x_slots needs ep == 1"),
    # likewise one rank only (its source change: tests/test_memory.py)
    "keep_h": (True, "keep_h needs ep == 1"),
    "arch": ("sm_100a", "sm_90a"),  # plans for other GPUs serve mokgen.harness.simulate only
    "gpu": ("h100-pcie", {"fwd", "bwd"}),  # 114 SMs: the launches' CTAs
    "reserve_sms": (16, {"fwd", "bwd"}),
    "overlap_comm": (True, {"fwd", "bwd"}),
    "profile": (("no_routed_wgrad",), {"fwd", "bwd"}),
    "gemm_fwd": ((128, 256, 4, True), {"fwd"}),  # multicast pairs
    "gemm_bwd": ((128, 256, 3), "stages must be one of"),  # 4 stages, no pairs
}
# Flips are made with every other decision pinned to BASE's (so a flip shows its own effect,
# not a pass re-choosing downstream), except the decision a flipped one sizes or drives.
DRIVES = {"minibatch": "macrobatch", "ring_budget_bytes": "macrobatch",
          "overlap_comm": "reserve_sms"}
REFUSED_TILES = [((128, 128, 4), "bn must be one of"), ((64, 256, 4), "bm must be one of"),
                 ((128, 256, 5), "stages must be one of"), ((128, 256, 1), "stages")]


def test_every_overridable_field_has_a_case():
    assert set(FLIPS) == set(OVERRIDABLE)


@pytest.mark.parametrize("field", sorted(FLIPS))
def test_flipping_a_decision_changes_the_source_or_is_refused(field):
    value, expect = FLIPS[field]
    assert getattr(BASE, field) != value
    pinned = {k: v for k, v in BASE.decisions().items() if k != DRIVES.get(field)}
    if isinstance(expect, str):
        with pytest.raises(ValueError, match=expect):
            codegen.emit(mokgen.plan(SHAPE, **ARGS, **{**pinned, field: value}))
        return
    base = sources(mokgen.plan(SHAPE, **ARGS, **pinned))
    assert base == sources(BASE)
    new = sources(mokgen.plan(SHAPE, **ARGS, **{**pinned, field: value}))
    assert {u for u in ALL if base[u] != new[u]} == expect


@pytest.mark.parametrize("tile,why", REFUSED_TILES)
@pytest.mark.parametrize("field", ["gemm_fwd", "gemm_bwd"])
def test_tiles_the_kernels_lack_are_refused(field, tile, why):
    with pytest.raises(ValueError, match=f"{field}.{why}"):
        mokgen.plan(SHAPE, **ARGS, **{field: tile})


def test_dtype_reaches_the_scale_block():
    for dtype, q in (("bf16", 0), ("fp8", 128), ("mxfp8", 32)):
        src = sources(mokgen.plan(SHAPE, **ARGS, dtype=dtype))
        assert f"/*Q*/ {q}>" in src["fwd"] and f"/*Q*/ {q}," in src["bwd"]


def test_tile_reaches_the_gemm_engine_and_the_workspace():
    p = mokgen.plan(SHAPE, **ARGS, gemm_fwd=(128, 256, 4, True))
    src = sources(p)
    assert "GemmCfg</*BN*/ 256, /*STAGES*/ 4," in src["fwd"] and "/*PAIR*/ true>" in src["fwd"]
    assert "GemmCfg</*BN*/ 256, /*STAGES*/ 4," in src["bwd"] and "PAIR" not in src["bwd"]
    assert f"constexpr int TILE = {p.block_m};" in src["prologue"]
    # the backward's weight-gradient partial sums are sized by the plan's tile, not a constant
    spec = layer_spec(p)
    assert spec.block_n == p.gemm_bwd.bn
    narrow = backward_tiles(dataclasses.replace(spec, block_n=spec.block_n // 2))
    assert narrow[0] == 2 * backward_tiles(spec)[0]


def test_gemm_tuples_are_checked_and_an_unset_pair_is_the_default():
    """gemm_fwd / gemm_bwd: (bm, bn, stages[, pair]); the default plan's JSON (and key) has
    the three ints alone; an explicit pair=False is the default plan's source (forced, so a
    different key); anything else is refused with the argument's name."""
    plain = mokgen.plan(SHAPE, **ARGS)
    assert '"gemm_fwd": [\n    128,\n    256,\n    4\n  ]' in plain.to_json()
    base = sources(plain)
    same = mokgen.plan(SHAPE, **ARGS, gemm_fwd=(128, 256, 4, False))
    assert same.gemm_fwd == GemmConfig(128, 256, 4) and same.key() != plain.key()
    assert sources(same)["fwd"].split("\n")[1:] == base["fwd"].split("\n")[1:]
    for bad in ((128, 256, 4, 1), (128, 256, 4, True, False), (128, 256, 4, "yes"),
                (128, 256), (128, 256, 0)):
        with pytest.raises(ValueError, match="gemm_bwd must be"):
            mokgen.plan(SHAPE, **ARGS, gemm_bwd=bad)


def test_plan_json_and_replace_lower_through_the_passes():
    """A plan without its graph (JSON, replace) gets the graph its decisions make, and
    renders the same kernels; a plan whose fields its decisions do not make is refused."""
    p = mokgen.plan(SHAPE, **ARGS, gemm_fwd=(128, 256, 4, True))
    back = Plan.from_json(p.to_json())
    assert back == p and back.graph is None and back.gemm_fwd == GemmConfig(128, 256, 4, True)
    assert sources(back) == sources(p)
    with pytest.raises(ValueError, match="ring_bytes=1 .*its decisions give"):
        codegen.emit(p.replace(ring_bytes=1))


# --- per operator ---------------------------------------------------------------------------

def test_ops_lower_to_the_parameters_their_annotations_decide():
    g = BASE.graph
    assert op_params(ir.op_of(g, OpKind.DISPATCH)) == dict(
        comm_sms=BASE.comm_sms_fwd, minibatch=BASE.minibatch, ring_rows=BASE.macrobatch,
        scale_block=0)
    assert "gather" not in op_params(ir.op_of(g, OpKind.REVERSE_COMBINE))
    assert "dx_ring" not in op_params(ir.op_of(g, OpKind.REVERSE_DISPATCH))
    assert op_params(ir.op_of(g, OpKind.SHARED_FFN)) == dict(
        compute_ctas=BASE.num_sms - BASE.comm_sms_fwd, gemm=BASE.gemm_fwd, block_m=128)
    assert op_params(ir.op_of(g, OpKind.SCHEDULE_BUILD))["block_m"] == 128
    assert op_params(ir.op_of(g, OpKind.ROUTE_TOPK)) == {}
    assert lower(g, "bwd")["comm_sms"] == BASE.comm_sms_bwd


def _with(g, changes):
    return Plan.of(ir.annotate(g, changes))


def test_an_op_annotated_by_hand_reaches_the_source():
    """Annotate the graph directly (what a new pass would do): every forward GEMM op gets
    multicast pairs; only the forward kernel changes."""
    g = BASE.graph
    pairs = {op.name: {"gemm": GemmConfig(128, 256, 4, pair=True)} for op in ir.gemm_ops(g, "fwd")}
    p = _with(g, pairs)
    assert p.gemm_fwd.pair and not p.gemm_bwd.pair
    base, new = sources(BASE), sources(p)
    assert new["fwd"] != base["fwd"] and "/*PAIR*/ true>" in new["fwd"]
    assert (new["bwd"], new["prologue"]) == (base["bwd"], base["prologue"])


@pytest.mark.parametrize("op,attrs,why", [
    ("down_gemm", {"gemm": GemmConfig(128, 256, 3)}, "share one gemm"),  # one engine a kernel
    ("combine", {"ctas": 9}, "share one ctas"),  # dispatch and combine: one comm role
    ("replay", {"minibatch": 256}, "share one minibatch"),  # one ring, one minibatch
])
def test_ops_of_one_kernel_that_disagree_are_refused(op, attrs, why):
    with pytest.raises(ValueError, match=why):
        _with(BASE.graph, {op: attrs})
    changed = ir.annotate(BASE.graph, {op: attrs})
    with pytest.raises(ValueError, match="instantiates one|share one"):
        lower(changed, ir.op_of(changed, OpKind(op)).direction)


def test_multicast_pairs_are_a_decision_that_reaches_the_forward():
    """GemmConfig.pair: the forward's source only (its GemmCfg's PAIR and the cluster the host
    launches it in), kept through JSON, comm CTAs rounded up to whole pairs by the planner;
    refused for the backward, fp8, gathered rows and odd CTA counts, at plan time."""
    pair_cfg = (128, 256, 4, True)
    plain = mokgen.plan(SHAPE, **ARGS)
    pair = mokgen.plan(SHAPE, **ARGS, gemm_fwd=pair_cfg)
    assert pair.gemm_fwd.pair and not pair.gemm_bwd.pair and not plain.gemm_fwd.pair
    assert "multicast pairs" in str(pair) and "multicast" not in str(plain)
    base, new = sources(plain), sources(pair)
    assert "/*EPI_BYTES*/ 32768, /*PAIR*/ true>" in new["fwd"] and "PAIR*/" not in base["fwd"]
    assert "mokgen_fwd_cluster = 2;" in new["fwd"] and "mokgen_fwd_cluster = 1;" in base["fwd"]
    assert new["bwd"].split("\n")[1:] == base["bwd"].split("\n")[1:]  # past the key line
    assert Plan.from_json(pair.to_json()) == pair
    assert '"gemm_fwd": [\n    128,\n    256,\n    4,\n    true\n  ]' in pair.to_json()
    assert pair.comm_sms_fwd % 2 == 0 and pair.comm_sms_fwd - plain.comm_sms_fwd in (0, 1)
    for kw, match in ((dict(gemm_bwd=pair_cfg), "gemm_bwd.pair must be False"),
                      (dict(dtype="fp8", gemm_fwd=pair_cfg), "gemm_fwd.pair needs dtype bf16"),
                      (dict(gemm_fwd=pair_cfg, comm_sms_fwd=3), "even comm_sms_fwd"),
                      (dict(gemm_fwd=pair_cfg, reserve_sms=1), "even num_sms"),
                      (dict(ep=1, gemm_fwd=pair_cfg, dispatch="gather"),
                       "gemm_fwd.pair needs dispatch other than 'gather'")):
        with pytest.raises(ValueError, match=match):
            mokgen.plan(SHAPE, **dict(ARGS, **kw))


def test_epilogue_staging_follows_the_precision():
    """bf16 kernels stage epilogues in the shared memory beside the 4 stages: the backward's
    whole-expert weight-gradient tiles (for TMA stores), the forward's routed down rows;
    fp8 plans, whose stages hold scales too, do not."""
    bf16 = sources(mokgen.plan(SHAPE, **ARGS))
    fp8 = sources(mokgen.plan(SHAPE, **ARGS, dtype="fp8"))
    assert "/*EPI_BYTES*/ 32768>" in bf16["bwd"] and "/*EPI_BYTES*/ 32768>" in bf16["fwd"]
    assert "EPI_BYTES" not in fp8["bwd"] and "EPI_BYTES" not in fp8["fwd"]


def test_epilogue_staging_takes_the_room_the_stages_leave():
    """4 stages of 128 x 256 (with or without the pairs' mailbox) leave room for 32 KB of
    epilogue staging: two 8 KB boxes a consumer warpgroup in the backward, 4 KB a consumer
    warp in the forward (its staged down rows), none in fp8; a smaller shared memory none (the
    kernel's GemmCfg checks the total against 227 KB when it compiles)."""
    from mokgen.compiler.lower import stage_bytes

    assert stage_bytes(GemmConfig(128, 256, 4)) == stage_bytes(GemmConfig(128, 256, 4, True)) \
        == 32768
    assert stage_bytes(GemmConfig(128, 256, 4), smem=200 * 1024) == 0
    bf16, fp8 = (sources(mokgen.plan(SHAPE, **ARGS, dtype=d)) for d in ("bf16", "fp8"))
    assert "/*EPI_BYTES*/ 32768>" in bf16["bwd"] and "/*EPI_BYTES*/ 32768>" in bf16["fwd"]
    assert "EPI_BYTES" not in fp8["bwd"] and "EPI_BYTES" not in fp8["fwd"]

def test_the_hosts_engine_bytes_are_gemm_test_cus():
    """lower.smem_bytes, the host's one mirror of GemmCfg's layout, gives the sizes gemm_test.cu
    asserts for its whole-task ping-pong configurations (PtCfg<TN, ST>) and the CTA pairs'
    (PAIR: the mailbox), read from its static_asserts: the standalone kernels' launches and
    the planner's staging room (stage_bytes) cannot drift from the engine's bytes unseen."""
    import os
    import re

    from mokgen.compiler.lower import smem_bytes

    src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "cuda", "gemm_test.cu")).read()
    asserted = re.findall(r"PtCfg<(\d+)(?:, (\d+))?>::SMEM_BYTES == (\d+)", src)
    assert len(asserted) == 3, asserted
    for tn, st, size in asserted:  # PtCfg<TN>: 6 stages at 128 columns, else 5
        stages = int(st) if st else 6 if tn == "128" else 5
        assert smem_bytes(GemmConfig(128, int(tn), stages)) == int(size), (tn, st)
    pair = re.findall(r"GemmCfg<256, 4, 0, 0, 4, 0, true>::SMEM_BYTES == (\d+)", src)
    assert pair and smem_bytes(GemmConfig(128, 256, 4, pair=True)) == int(pair[0]), pair


def test_default_tile_is_a_supported_one():
    t = limits.DEFAULT_GEMM
    assert t.bm in limits.GEMM_BM and t.bn in limits.GEMM_BN and t.stages in limits.GEMM_STAGES
    assert t.pair is False and False in limits.GEMM_PAIR
