"""Shapes, plan validation, JSON, and each planning pass alone."""
import json

import pytest

import mokgen
from mokgen.compiler import codegen, ir, limits, passes
from mokgen.cli import main
from mokgen.compiler.ir import OpKind
from mokgen.compiler.plan import COMM_OPS, Plan, initial_graph

PRESETS = ("kimi-k2.7", "glm-5.2", "qwen3.5-397b-a17b", "deepseek-v4-pro")


def test_presets_match_design():
    s = mokgen.shapes.get("kimi-k2.7")
    assert (s.num_experts, s.hidden, s.intermediate, s.topk, s.shared_experts) == \
        (384, 7168, 2048, 8, 1)
    assert (mokgen.shapes.get("deepseek-v4-pro").intermediate,
            mokgen.shapes.get("qwen3.5-397b-a17b").topk,
            mokgen.shapes.get("glm-5.2").num_experts) == (3072, 10, 256)
    assert set(PRESETS) <= set(mokgen.shapes.names())


@pytest.mark.parametrize("kw,field", [
    (dict(num_experts=0), "num_experts"), (dict(topk=9), "topk"), (dict(hidden=100), "hidden"),
    (dict(activation="gelu"), "activation"), (dict(shared_intermediate=-1), "shared_intermediate"),
])
def test_shape_validation_names_the_field(kw, field):
    args = dict(num_experts=8, hidden=64, intermediate=32, topk=2) | kw
    with pytest.raises(ValueError, match=field):
        mokgen.MoEShape(**args)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("ep", [8, 64])
@pytest.mark.parametrize("tokens", [1024, 2048, 4096])
@pytest.mark.parametrize("dtype", ["bf16", "mxfp8"])
def test_plan_presets(name, ep, tokens, dtype):
    p = mokgen.plan(mokgen.shapes.get(name), ep=ep, dtype=dtype, tokens_per_rank=tokens)
    d = json.loads(p.to_json())
    for key in ("dispatch", "combine", "comm_sms_fwd", "comm_sms_bwd", "minibatch",
                "macrobatch", "ep", "dtype"):
        assert key in d
    assert (d["dispatch"], d["combine"]) == ("pull", "push")
    assert (p.reverse_combine, p.reverse_dispatch) == ("pull", "push")
    assert p.minibatch % p.block_m == 0 and p.macrobatch % p.minibatch == 0
    assert 0 < p.comm_sms_fwd < p.num_sms and 0 < p.comm_sms_bwd < p.num_sms
    assert mokgen.Plan.from_json(p.to_json()) == p
    assert "dispatch=pull" in str(p)


@pytest.mark.parametrize("kw,arg", [
    (dict(ep=7), "ep"), (dict(dtype="fp4"), "dtype"), (dict(tokens_per_rank=0), "tokens_per_rank"),
    (dict(tokens_per_rank=-5), "tokens_per_rank"), (dict(minibatch=100), "minibatch"),
    (dict(macrobatch=300, minibatch=128), "macrobatch"), (dict(dispatch="both"), "dispatch"),
    (dict(macrobatch=128, minibatch=128), "macrobatch"),
    (dict(comm_sms_fwd=500), "comm_sms_fwd"), (dict(bogus=1), "bogus"), (dict(arch="sm_80"), "arch"),
])
def test_plan_rejects_bad_arguments(kw, arg):
    args = dict(ep=8, dtype="bf16", tokens_per_rank=1024) | kw
    with pytest.raises(ValueError, match=arg):
        mokgen.plan(mokgen.shapes.get("glm-5.2"), **args)


def test_unknown_preset_and_topk():
    with pytest.raises(ValueError, match="preset"):
        mokgen.shapes.get("gpt-oss")
    with pytest.raises(ValueError, match="topk"):
        mokgen.MoEShape(4, 64, 32, 5)
    with pytest.raises(TypeError, match="shape"):
        mokgen.plan("kimi-k2.7", ep=8)


def base(**kw):
    return initial_graph(mokgen.shapes.get("kimi-k2.7"), 64, kw.pop("dtype", "bf16"), 2048, **kw)


def upto(last, **kw):
    """The graph of base(**kw) after the passes up to and including `last`."""
    g = base(**kw)
    for run_pass in passes.PASSES:
        g = run_pass(g)
        if run_pass.__name__ == last:
            return g
    raise AssertionError(last)


def test_passes_annotate_a_copy_and_leave_their_input_alone():
    g = base()
    before = {op.name: op.attrs for op in ir.ops(g)}
    for run_pass in passes.PASSES:
        out = run_pass(g)
        assert {op.name: op.attrs for op in ir.ops(g)} == before, run_pass.__name__
        assert list(out.edges) == list(g.edges)  # annotations only: the layer stays the same
        g, before = out, {op.name: op.attrs for op in ir.ops(out)}


def test_comm_direction_pass_names_the_paper_s_directions_or_gathered_rows():
    g = upto("comm_direction")
    p = Plan.of(g)
    assert [getattr(p, op) for op in COMM_OPS] == ["pull", "push", "pull", "push"]
    assert ir.op_of(g, OpKind.DISPATCH).attr("comm_direction") == "pull"
    # one rank: the paper's directions; asked for, bf16 moves no rows (the GEMMs gather
    # them, no comm CTAs), fp8 cannot
    one = mokgen.plan(mokgen.shapes.get("tiny"), ep=1, tokens_per_rank=8)
    assert (one.dispatch, one.combine) == ("pull", "push")
    g = mokgen.plan(mokgen.shapes.get("tiny"), ep=1, tokens_per_rank=8, dispatch="gather")
    assert (g.dispatch, g.combine, g.reverse_combine, g.reverse_dispatch) == \
        ("gather", "push", "gather", "push")
    assert g.comm_sms_fwd == g.comm_sms_bwd == 0 and g.macrobatch >= g.max_routed_rows
    assert g.ring_bytes < one.ring_bytes  # no x row
    with pytest.raises(ValueError, match="gather"):
        mokgen.plan(mokgen.shapes.get("tiny"), ep=1, tokens_per_rank=8, dispatch="gather",
                    dtype="fp8")
    with pytest.raises(ValueError, match="ep == 1"):
        mokgen.plan(mokgen.shapes.get("tiny"), ep=2, tokens_per_rank=8, dispatch="gather")
    # the forward gathers alone: no forward comm CTAs, the backward's pull x beside dy (its
    # comm model moves both), the ring keeps its x rows for them
    h = mokgen.plan(mokgen.shapes.get("tiny"), ep=1, tokens_per_rank=8, dispatch="gather",
                    reverse_combine="pull")
    assert (h.dispatch, h.combine, h.reverse_combine) == ("gather", "push", "pull")
    assert h.comm_sms_fwd == 0 and h.comm_sms_bwd >= 1 and h.macrobatch >= h.max_routed_rows
    assert h.ring_bytes // h.macrobatch == one.ring_bytes // one.macrobatch  # x rows kept
    src = {k.name.split("_")[0]: k.source for k in codegen.emit(h)}
    assert "/*GATHER*/ true" in src["fwd"] and "XPULL" not in src["fwd"]
    assert "/*GATHER*/ false, /*XPULL*/ true" in src["bwd"]
    q3 = mokgen.shapes.get("qwen3-30b-a3b")
    assert mokgen.plan(q3, ep=1, tokens_per_rank=8192, dispatch="gather",
                       reverse_combine="pull").comm_sms_bwd > \
        mokgen.plan(q3, ep=1, tokens_per_rank=8192, keep_h=False).comm_sms_bwd  # x and dy
    with pytest.raises(ValueError, match="needs dispatch='gather'"):
        mokgen.plan(mokgen.shapes.get("tiny"), ep=1, tokens_per_rank=8, dispatch="pull",
                    reverse_combine="gather")


def test_precision_pass():
    assert Plan.of(passes.precision(base())).row_bytes == 2 * 7168
    g = passes.precision(base(dtype="mxfp8"))
    mx = Plan.of(g)
    assert mx.scale_block == 32 and mx.shared_dtype == "bf16" and mx.act_dtype == "mxfp8_e4m3"
    assert any("swiglu" in q for q in mx.quant_fused)
    # per op: the routed GEMMs read e4m3, the weight gradients and the shared expert bf16
    assert ir.op_of(g, OpKind.DOWN_DGRAD).attr("precision") == "mxfp8_e4m3"
    assert ir.op_of(g, OpKind.WEIGHT_GRAD_W1).attr("precision") == "bf16"
    assert ir.op_of(g, OpKind.SHARED_FFN_BWD).attr("precision") == "bf16"
    fp8 = Plan.of(passes.precision(base(dtype="fp8")))
    assert fp8.scale_block == 128 and fp8.row_bytes == 7168 + 4 * 56  # e4m3 + fp32 scales
    assert Plan.of(passes.precision(base())).scale_block == 0


def test_sm_partition_pass_is_pure_and_respects_overrides():
    p = passes.precision(base())
    q = passes.sm_partition(p)
    assert Plan.of(p).comm_sms_fwd is None and Plan.of(q).comm_sms_fwd  # input untouched
    roles = {op.name: op.attr("sm_role") for op in ir.ops(q)}
    assert roles["dispatch"] == roles["reverse_dispatch"] == "comm"
    assert roles["gate_up_gemm"] == roles["weight_grad_w1"] == "compute"
    assert roles["route_topk"] is None  # the prologue runs before the megakernel, on all SMs
    assert Plan.of(upto("sm_partition", comm_sms_fwd=20)).comm_sms_fwd == 20
    # blockwise fp8 computes faster and moves e4m3 rows: comm needs at least as many SMs as
    # for the same bytes at bf16's rate (MXFP8 computes at about bf16's rate: fewer)
    fp8 = Plan.of(upto("sm_partition", dtype="fp8"))
    mx = Plan.of(upto("sm_partition", dtype="mxfp8"))
    assert fp8.comm_sms_fwd > mx.comm_sms_fwd


def test_tiling_pass_gives_every_gemm_op_a_tile():
    g = upto("tiling")
    tiles = {op.name: op.attr("gemm") for op in ir.gemm_ops(g)}
    assert set(tiles) >= {"shared_ffn", "gate_up_gemm", "down_gemm", "replay", "weight_grad_w2"}
    assert set(tiles.values()) == {limits.DEFAULT_GEMM}
    forced = Plan.of(upto("tiling", gemm_fwd=(128, 256, 4, True)))
    assert forced.gemm_fwd == ir.GemmConfig(128, 256, 4, True)
    assert forced.gemm_bwd == limits.DEFAULT_GEMM
    assert forced.block_m == 128


def test_granularity_pass():
    g = Plan.of(upto("granularity"))
    assert g.minibatch % g.block_m == 0 and g.minibatch <= 2048 * 8 + g.block_m
    assert Plan.of(upto("granularity", minibatch=256)).minibatch == 256


def test_granularity_weight_rereads():
    """Each minibatch re-reads the weights of the experts it touches: the term falls with the
    minibatch, counts a byte an element for fp8, the backward's reads only when asked, and
    moves few large experts (Mixtral-8x7B, 352 MB an expert) to larger minibatches than the
    flag and wave terms alone chose (512; measured: NOTES, ninth session)."""
    from mokgen.compiler import hardware
    from mokgen.compiler.passes.granularity import minibatch_cost, weight_reread_s

    gpu = hardware.get("H200")
    mix = mokgen.shapes.get("mixtral-8x7b")
    p = mokgen.plan(mix, ep=1, tokens_per_rank=4096)
    costs = [weight_reread_s(p, b, gpu) for b in (256, 512, 1024, 2048)]
    assert costs == sorted(costs, reverse=True) and costs[0] > 2 * costs[-1]
    # 4096 x 2 rows over 8 experts; 1024-row minibatches: 8 of them, each touching 2 experts
    assert weight_reread_s(p, 1024, gpu) == pytest.approx(
        gpu.hbm_exposed * 8 * 2 * 3 * 4096 * 14336 * 2 / gpu.hbm_bw)
    f8 = mokgen.plan(mix, ep=1, tokens_per_rank=4096, dtype="fp8")
    assert weight_reread_s(f8, 1024, gpu) == pytest.approx(weight_reread_s(p, 1024, gpu) / 2)
    b = p.minibatch
    assert minibatch_cost(p, b, gpu, backward=True) - minibatch_cost(p, b, gpu) == \
        pytest.approx(weight_reread_s(p, b, gpu))
    assert p.minibatch >= 1024


def test_granularity_rereads_move_large_experts_only(monkeypatch):
    """The re-read term moves the choice only where what it saves is a material share of the
    compute (REREAD_MARGIN): Mixtral-8x7B's 352 MB experts, not Qwen3-235B's 38 MB ones."""
    import sys

    g = sys.modules["mokgen.compiler.passes.granularity"]
    cases = [(mokgen.shapes.get("mixtral-8x7b"), 1), (mokgen.shapes.get("qwen3-235b-a22b"), 1)]
    picks = lambda: [mokgen.plan(s, ep=ep, tokens_per_rank=4096).minibatch  # noqa: E731
                     for s, ep in cases]
    with_term = picks()
    with monkeypatch.context() as m:  # no margin: the term alone would move Qwen3-235B too
        m.setattr(g, "REREAD_MARGIN", 0.0)
        unguarded = picks()
    monkeypatch.setattr(g, "weight_reread_s", lambda *a, **k: 0.0)
    without = picks()
    assert with_term[0] > without[0] and with_term[1] == without[1] != unguarded[1]


def test_ring_pass_budget_and_replay():
    r = Plan.of(upto("ring"))
    assert r.macrobatch >= r.expected_routed_rows and r.expected_replay_rows == 0
    small = Plan.of(upto("ring", ring_budget_bytes=64 << 20))
    # the ring holds at least two minibatches, even past a budget too small for them
    assert small.ring_bytes <= 64 << 20 or small.macrobatch == 2 * small.minibatch
    assert small.expected_replay_rows == small.expected_routed_rows - small.macrobatch > 0


def test_plan_key_is_stable_and_sensitive():
    s = mokgen.shapes.get("glm-5.2")
    a, b = mokgen.plan(s, ep=8), mokgen.plan(s, ep=8)
    assert a.key() == b.key()
    assert a.key() != mokgen.plan(s, ep=8, minibatch=256).key()


def test_cli_plan(capsys):
    assert main(["plan", "--shape", "qwen3.5-397b-a17b", "--ep", "64", "--tokens", "1024",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ep"] == 64 and d["dispatch"] == "pull"
    assert main(["plan", "--shape", "tiny", "--ep", "3"]) == 2
    assert "ep" in capsys.readouterr().err
    assert main(["plan", "--shape", "tiny", "--ep", "2", "--graph", "dot"]) == 0
    assert "digraph" in capsys.readouterr().out
    assert main(["plan", "--shape", "tiny", "--ep", "2", "--json", "--gemm-fwd",
                 "128x256x4-pair"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gemm_fwd"] == [128, 256, 4, True] and d["gemm_bwd"] == [128, 256, 4]


def test_reserve_sms_leaves_sms_to_collectives():
    """reserve_sms (forced) or overlap_comm (the pass's default) shrinks the launch; the
    comm/compute split is re-chosen within the CTAs left; the source's CTA constant follows."""
    from mokgen.compiler import codegen
    from mokgen.compiler.passes.sm_partition import collective_sms
    from mokgen.runtime.checks import check_ctas

    s = mokgen.shapes.get("kimi-k2.7")
    full = mokgen.plan(s, ep=64, tokens_per_rank=2048)
    sms = full.gpu_sms  # the CPU default's (the H200's): 132
    assert (full.num_sms, full.reserve_sms) == (sms, 0)
    auto = mokgen.plan(s, ep=64, tokens_per_rank=2048, overlap_comm=True)
    assert auto.reserve_sms == collective_sms(full.target) == 16  # 450 GB/s / 40 GB/s a CTA
    assert auto.num_sms == sms - 16 and auto.comm_sms_fwd < auto.num_sms
    assert "16 SMs left to collectives" in str(auto)
    forced = mokgen.plan(s, ep=64, tokens_per_rank=2048, reserve_sms=40, overlap_comm=True)
    assert (forced.num_sms, forced.reserve_sms) == (sms - 40, 40)  # the forced count wins
    assert mokgen.Plan.from_json(forced.to_json()) == forced
    src = {k.name.split("_")[0]: k.source for k in codegen.emit(forced)}
    full_src = {k.name.split("_")[0]: k.source for k in codegen.emit(full)}
    for unit in ("fwd", "bwd"):
        assert f"int mokgen_{unit}_ctas = {sms - 40};" in src[unit]
        assert f"int mokgen_{unit}_ctas = {sms};" in full_src[unit]
    # the reserve follows the link: the H800's 200 GB/s a direction needs 8
    h800 = mokgen.plan(s, ep=64, tokens_per_rank=2048, overlap_comm=True, gpu="h800")
    assert (h800.reserve_sms, h800.num_sms) == (8, 124)
    assert check_ctas("forward", 116, 132) == 116
    with pytest.raises(ValueError, match="132 CTAs .* has 114 SMs"):
        check_ctas("forward", 132, 114)


@pytest.mark.parametrize("kw,arg", [
    (dict(reserve_sms=-1), "reserve_sms"), (dict(reserve_sms=67), "reserve_sms"),
    (dict(reserve_sms=True), "reserve_sms"), (dict(overlap_comm=1), "overlap_comm"),
    (dict(reserve_sms=60, comm_sms_fwd=72), "comm_sms_fwd"),
])
def test_reserve_sms_is_checked(kw, arg):
    with pytest.raises(ValueError, match=arg):
        mokgen.plan(mokgen.shapes.get("glm-5.2"), ep=8, tokens_per_rank=1024, **kw)


def test_overlap_comm_forced_comm_sms_must_fit_the_launch():
    with pytest.raises(ValueError, match="comm_sms_bwd must be < 116"):  # the H200's 132 - 16
        mokgen.plan(mokgen.shapes.get("glm-5.2"), ep=8, tokens_per_rank=1024,
                    overlap_comm=True, comm_sms_bwd=120)
