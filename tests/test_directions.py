"""The communication directions (CPU): both ways for dispatch and combine (forward) and for
reverse-combine and reverse-dispatch (backward), chosen by the comm_direction pass's cost model
or forced, each way its own kernel source. GPU checks: test_gpu_directions.py,
test_multigpu.py."""
import itertools

import pytest

import mokgen
from mokgen.compiler import build, codegen
from mokgen.compiler.lower import layer_spec
from mokgen.compiler.passes.comm_direction import (backward_costs, choose_backward, choose_forward,
                                          forward_costs)
from mokgen.compiler.passes.ring import ring_row_bytes
from mokgen.runtime import abi
from mokgen.runtime.peers import BWD_DIR_KINDS, DIR_KINDS, peer_shapes
from mokgen.runtime.workspace import workspace_bytes

SHAPE = mokgen.shapes.get("gpu-small")
ARGS = dict(ep=2, tokens_per_rank=1024)
FORWARD = list(itertools.product(("pull", "push"), ("push", "pull")))  # (dispatch, combine)
# (reverse_combine, reverse_dispatch), the paper's first
BACKWARD = list(itertools.product(("pull", "push"), ("push", "pull")))


def fwd_source(plan) -> str:
    (k,) = [k for k in codegen.emit(plan, units=("fwd",))]
    return k.source.replace(plan.key(), "<key>")


def bwd_source(plan) -> str:
    (k,) = [k for k in codegen.emit(plan, units=("bwd",))]
    return k.source.replace(plan.key(), "<key>")


def test_every_direction_plans_and_each_direction_keeps_the_other_s_paper_choice():
    for d, c in FORWARD:
        p = mokgen.plan(SHAPE, **ARGS, dispatch=d, combine=c)
        assert (p.dispatch, p.combine) == (d, c)
        assert (p.reverse_combine, p.reverse_dispatch) == ("pull", "push")
        assert f"dispatch={d} combine={c}" in str(p)
    for rc, rd in BACKWARD:
        p = mokgen.plan(SHAPE, **ARGS, reverse_combine=rc, reverse_dispatch=rd)
        assert (p.reverse_combine, p.reverse_dispatch) == (rc, rd)
        assert (p.dispatch, p.combine) == ("pull", "push")
        assert f"reverse_combine={rc} reverse_dispatch={rd}" in str(p)
        assert mokgen.Plan.from_json(p.to_json()).reverse_combine == rc
    for op in ("dispatch", "reverse_combine", "reverse_dispatch"):
        with pytest.raises(ValueError, match=f"{op} must be one of"):
            mokgen.plan(SHAPE, **ARGS, **{op: "both"})


def other_directions_sources(render, pairs, absent) -> dict:
    """render(pair) for each direction pair: four different sources, and the paper's
    (pull, push) has none of `absent` (it renders the source it rendered before the other
    directions existed). -> the other three pairs' sources."""
    src = {pair: render(pair) for pair in pairs}
    assert len(set(src.values())) == 4
    default = src.pop(("pull", "push"))
    assert not [a for a in absent if a in default]
    return src


def test_each_direction_renders_its_own_forward_and_the_default_none_of_it():
    src = other_directions_sources(
        lambda dc: fwd_source(mokgen.plan(SHAPE, **ARGS, minibatch=512, macrobatch=2048,
                                          comm_sms_fwd=8, dispatch=dc[0], combine=dc[1])),
        FORWARD, ("DPUSH", "DirPeers", "&dir"))
    for (d, c), s in src.items():
        assert f"/*DPUSH*/ {str(d == 'push').lower()}, /*CPULL*/ {str(c == 'pull').lower()}>" in s
        assert "mokgen::DirPeers<C::R> dir" in s and "fwd_comm<C, Cfg>(peers, buf, &dir)" in s
        assert "static_assert(sizeof(mokgen::DirPeers<2>) == 80" in s
    # the other units do not depend on the forward's directions
    a = codegen.emit(mokgen.plan(SHAPE, **ARGS, minibatch=512, macrobatch=2048))
    b = codegen.emit(mokgen.plan(SHAPE, **ARGS, minibatch=512, macrobatch=2048,
                                 dispatch="push", combine="pull"))
    for ka, kb in zip(a, b):
        if not ka.name.startswith("fwd"):
            assert ka.source.split("\n", 1)[1] == kb.source.split("\n", 1)[1], ka.name


def test_refusals_name_the_rule():
    with pytest.raises(ValueError, match="dispatch='push' moves bf16 rows only"):
        mokgen.plan(SHAPE, **ARGS, dtype="fp8", dispatch="push")
    with pytest.raises(ValueError, match="combine='pull' needs comm_sms_fwd >= 2"):
        mokgen.plan(SHAPE, **ARGS, combine="pull", comm_sms_fwd=1)
    # fp8 pulls its combine rows like bf16: the down epilogue's output is bf16 either way
    assert mokgen.plan(SHAPE, **ARGS, dtype="fp8", combine="pull").combine == "pull"


def paper_pair_priced_cheapest(costs, pairs, pushed: str, chosen) -> dict:
    """kimi-k2.7 at ep 8 over NVLink: -> {pair: costs(plan, *pair)}, having checked
    that the cross-GPU signals and the peer table scans make the paper's pair (pull, push)
    the cheapest and the plan's choice (`chosen(plan)`), and that pushing op `pushed` pays R
    cross-GPU arrivals + the slot-free poll per minibatch where pulling it pays one local
    hand-off."""
    p = mokgen.plan(mokgen.shapes.get("kimi-k2.7"), ep=8, tokens_per_rank=2048)
    cost = {pair: costs(p, *pair) for pair in pairs}
    assert min(cost, key=lambda pair: cost[pair]["total"]) == ("pull", "push")
    assert chosen(p) == ("pull", "push")
    gpu = p.target
    minibatches = -(-p.tokens_per_rank * p.shape.topk // p.minibatch)
    extra = cost[("push", "push")][pushed] - cost[("pull", "push")][pushed]
    assert extra >= minibatches * ((p.ep + 1) * gpu.peer_flag_latency - gpu.flag_latency)
    return cost


def test_cost_model_prices_bytes_sms_and_signals():
    cost = paper_pair_priced_cheapest(forward_costs, FORWARD, "dispatch",
                                      lambda p: (p.dispatch, p.combine))
    # more ranks: more signals per minibatch, so push costs more
    p64 = mokgen.plan(mokgen.shapes.get("kimi-k2.7"), ep=64, tokens_per_rank=2048)
    assert forward_costs(p64, "push", "push")["dispatch"] > cost[("push", "push")]["dispatch"]
    # pull combine needs a comm CTA of its own to pull with
    one = mokgen.plan(SHAPE, **ARGS, comm_sms_fwd=1)
    assert forward_costs(one, "pull", "pull")["total"] == float("inf")
    # one rank: nothing crosses a GPU, every way ties, the paper's choice stays
    solo = mokgen.plan(SHAPE, ep=1, tokens_per_rank=256)
    assert (solo.dispatch, solo.combine) == ("pull", "push")


def test_forcing_one_op_lets_the_model_pick_the_other():
    p = mokgen.plan(SHAPE, **ARGS, dispatch="push")
    assert p.dispatch == "push" and p.combine == choose_forward(p, {"dispatch": "push"})[1]
    assert choose_forward(p, {"combine": "pull"})[1] == "pull"
    # a forced pull combine gets the two comm CTAs it needs from the SM partition
    q = mokgen.plan(mokgen.shapes.get("tiny"), ep=2, tokens_per_rank=8, combine="pull")
    assert q.comm_sms_fwd >= 2


def test_pull_combine_stages_a_row_per_ring_row_and_reports_it():
    base = mokgen.plan(SHAPE, **ARGS, minibatch=512, macrobatch=2048)
    pulled = mokgen.plan(SHAPE, **ARGS, minibatch=512, macrobatch=2048, combine="pull")
    assert ring_row_bytes(pulled) == ring_row_bytes(base) + 2 * SHAPE.hidden
    assert pulled.ring_bytes == base.ring_bytes + 2048 * 2 * SHAPE.hidden
    spec, dspec = layer_spec(base), layer_spec(pulled)
    assert (dspec.dispatch, dspec.combine) == ("pull", "pull") and dspec.peer_directions
    assert not spec.peer_directions and not set(DIR_KINDS) & set(peer_shapes(spec))
    shapes = peer_shapes(dspec)
    assert shapes["stage"][0] == (2048, SHAPE.hidden)
    assert shapes["xflags"][0] == (abi.XFLAG_WORDS * dspec.max_minibatches,)
    # the ring, schedule and flags moved to peer memory; the staging rows came on top
    assert workspace_bytes(dspec)["total"] >= workspace_bytes(spec)["total"] + \
        2048 * 2 * SHAPE.hidden


def test_dir_peers_struct_packs_one_pointer_per_rank():
    offsets, size = abi.layout(abi.FWD_DIR_PEERS, ranks=4)
    assert offsets == {"xflags": 0, "ring_x": 32, "table": 64, "meta": 96, "stage": 128}
    assert size == 160
    raw = abi.pack(abi.FWD_DIR_PEERS, ranks=2, xflags=[1, 2], ring_x=[3, 4], table=[5, 6],
                   meta=[7, 8], stage=[None, 9])
    import struct
    assert struct.unpack("<10Q", raw) == (1, 2, 3, 4, 5, 6, 7, 8, 0, 9)
    with pytest.raises(ValueError, match="needs 2 pointers"):
        abi.pack(abi.FWD_DIR_PEERS, ranks=2, xflags=[1], ring_x=[3, 4], table=[5, 6],
                 meta=[7, 8], stage=[0, 9])
    assert "push-dispatch" in abi.phase_text(5) and "pull combine" in abi.phase_text(7)


@pytest.mark.parametrize("dispatch,combine,dtype", [("push", "push", "bf16"),
                                                    ("pull", "pull", "bf16"),
                                                    ("push", "pull", "bf16"),
                                                    ("pull", "pull", "mxfp8")])
def test_direction_kernels_compile_without_spills(dispatch, combine, dtype):
    """nvcc builds every forward variant for sm_90a (the CPU suite's compile check)."""
    p = mokgen.plan(SHAPE, ep=4, tokens_per_rank=512, dtype=dtype, dispatch=dispatch,
                    combine=combine)
    (b,) = build.build(codegen.emit(p, units=("fwd",)), arch=p.arch)
    res = b.resources["mokgen_fwd"]
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0, res


# --- the backward's directions ---------------------------------------------------------------

def test_each_backward_direction_renders_its_own_backward_and_the_default_none_of_it():
    pinned = dict(ARGS, minibatch=512, macrobatch=2048, comm_sms_bwd=8)
    src = other_directions_sources(
        lambda rr: bwd_source(mokgen.plan(SHAPE, **pinned, reverse_combine=rr[0],
                                          reverse_dispatch=rr[1])),
        BACKWARD, ("RCPUSH", "BwdDirPeers", "&dir"))
    for (rc, rd), s in src.items():
        assert (f"/*RCPUSH*/ {str(rc == 'push').lower()},\n"
                f"                            /*RDPULL*/ {str(rd == 'pull').lower()}>") in s
        assert "/*DPUSH*/ false, /*CPULL*/ false" in s
        assert "mokgen::BwdDirPeers<C::R> dir" in s and "bwd_comm<C, Cfg>(peers, buf, &dir)" in s
        assert "&buf, {}, &dir}" in s
        assert "static_assert(sizeof(mokgen::BwdDirPeers<2>) == 96" in s
        assert "static_assert(mokgen::kPhaseDxStageSlot == 20" in s
    # the forward and the prologue do not depend on the backward's directions
    a = codegen.emit(mokgen.plan(SHAPE, **pinned))
    b = codegen.emit(mokgen.plan(SHAPE, **pinned, reverse_combine="push",
                                 reverse_dispatch="pull"))
    for ka, kb in zip(a, b):
        if not ka.name.startswith("bwd"):
            assert ka.source.split("\n", 1)[1] == kb.source.split("\n", 1)[1], ka.name


def test_both_directions_non_default_at_once_render_each_kernel_its_own():
    p = mokgen.plan(SHAPE, **ARGS, dispatch="push", combine="pull", reverse_combine="push",
                    reverse_dispatch="pull")
    fwd, bwd = fwd_source(p), bwd_source(p)
    assert "/*DPUSH*/ true, /*CPULL*/ true>" in fwd and "BwdDirPeers" not in fwd
    assert "/*DPUSH*/ false, /*CPULL*/ false, /*RCPUSH*/ true" in bwd
    assert "mokgen::DirPeers<" not in bwd
    spec = layer_spec(p)
    assert spec.peer_directions and spec.bwd_peer_directions
    # one set of direction buffers serves both kernels: flags, schedule, staging rows
    assert set(peer_shapes(spec)) >= set(DIR_KINDS) | set(BWD_DIR_KINDS)


def test_backward_refusals_name_the_rule():
    with pytest.raises(ValueError, match="reverse_combine='push' moves bf16 dy rows only"):
        mokgen.plan(SHAPE, **ARGS, dtype="fp8", reverse_combine="push")
    with pytest.raises(ValueError, match="reverse_combine='push' moves bf16 dy rows only"):
        mokgen.plan(SHAPE, **ARGS, dtype="mxfp8", reverse_combine="push")
    with pytest.raises(ValueError, match="reverse_dispatch='pull' needs comm_sms_bwd >= 2"):
        mokgen.plan(SHAPE, **ARGS, reverse_dispatch="pull", comm_sms_bwd=1)
    # fp8 pulls its dx rows like bf16: the dx epilogue's output is bf16 either way
    for dtype in ("fp8", "mxfp8"):
        p = mokgen.plan(SHAPE, **ARGS, dtype=dtype, reverse_dispatch="pull")
        assert p.reverse_dispatch == "pull" and "/*RDPULL*/ true" in bwd_source(p)
    # a forced pull reverse-dispatch gets the two comm CTAs it needs from the SM partition
    q = mokgen.plan(mokgen.shapes.get("tiny"), ep=2, tokens_per_rank=8, reverse_dispatch="pull")
    assert q.comm_sms_bwd >= 2


def test_backward_cost_model_prices_bytes_sms_and_signals():
    # push reverse-combine also has every owner scan every peer's table
    cost = paper_pair_priced_cheapest(backward_costs, BACKWARD, "reverse_combine",
                                      lambda p: (p.reverse_combine, p.reverse_dispatch))
    # pull reverse-dispatch: R cross-GPU polls a minibatch on half the comm CTAs, where push
    # stores from every compute SM's epilogue
    assert cost[("pull", "pull")]["reverse_dispatch"] > cost[("pull", "push")]["reverse_dispatch"]
    # the two ops' costs are independent: the total is their sum
    for rr, c in cost.items():
        assert c["total"] == pytest.approx(c["reverse_combine"] + c["reverse_dispatch"])
    p64 = mokgen.plan(mokgen.shapes.get("kimi-k2.7"), ep=64, tokens_per_rank=2048)
    assert backward_costs(p64, "push", "push")["reverse_combine"] > \
        cost[("push", "push")]["reverse_combine"]
    one = mokgen.plan(SHAPE, **ARGS, comm_sms_bwd=1)
    assert backward_costs(one, "pull", "pull")["total"] == float("inf")
    fp8 = mokgen.plan(SHAPE, **ARGS, dtype="fp8")
    assert backward_costs(fp8, "push", "push")["total"] == float("inf")
    assert (fp8.reverse_combine, fp8.reverse_dispatch) == ("pull", "push")
    solo = mokgen.plan(SHAPE, ep=1, tokens_per_rank=256)
    # one rank: the model's pull / push, then its dx rows left in the dy ring (dx_rows pass)
    assert (solo.reverse_combine, solo.reverse_dispatch) == ("pull", "ring")
    assert mokgen.plan(SHAPE, ep=1, tokens_per_rank=256,
                       reverse_dispatch="push").reverse_dispatch == "push"


def test_forcing_one_backward_op_lets_the_model_pick_the_other():
    p = mokgen.plan(SHAPE, **ARGS, reverse_combine="push")
    assert p.reverse_combine == "push"
    assert p.reverse_dispatch == choose_backward(p, {"reverse_combine": "push"})[1]
    assert choose_backward(p, {"reverse_dispatch": "pull"})[1] == "pull"
    # a forward override does not move the backward's choice, nor the other way round
    f = mokgen.plan(SHAPE, **ARGS, dispatch="push")
    assert (f.reverse_combine, f.reverse_dispatch) == ("pull", "push")


def test_pull_reverse_dispatch_stages_dx_rows_and_reports_them():
    base = mokgen.plan(SHAPE, **ARGS, minibatch=512, macrobatch=2048)
    pulled = mokgen.plan(SHAPE, **ARGS, minibatch=512, macrobatch=2048,
                         reverse_dispatch="pull")
    # a bf16 dx row and its fp32 router-weight gradient per ring row
    assert ring_row_bytes(pulled) == ring_row_bytes(base) + 2 * SHAPE.hidden + 4
    both = mokgen.plan(SHAPE, **ARGS, minibatch=512, macrobatch=2048, combine="pull",
                       reverse_dispatch="pull")
    assert ring_row_bytes(both) == ring_row_bytes(pulled)  # one set of staging rows
    spec, dspec = layer_spec(base), layer_spec(pulled)
    assert (dspec.reverse_combine, dspec.reverse_dispatch) == ("pull", "pull")
    assert dspec.bwd_peer_directions and not dspec.peer_directions
    assert not spec.bwd_peer_directions and not set(BWD_DIR_KINDS) & set(peer_shapes(spec))
    shapes = peer_shapes(dspec)
    assert set(BWD_DIR_KINDS) <= set(shapes) and "ring_x" not in shapes  # the forward's own
    assert shapes["stage"][0] == (2048, SHAPE.hidden) and shapes["stage_dw"][0] == (2048,)
    assert shapes["ring_dy"][0] == (2048, SHAPE.hidden)
    assert shapes["xflags"][0] == (abi.XFLAG_WORDS * dspec.max_minibatches,)
    assert abi.XFLAG_WORDS == 4  # dy_landed, slot_free, dx_pulled, dx_done
    pushed = layer_spec(mokgen.plan(SHAPE, **ARGS, minibatch=512, macrobatch=2048,
                                    reverse_combine="push"))
    assert peer_shapes(pushed)["stage"][0] == (1, SHAPE.hidden)  # nothing is staged
    # the dy ring moved to peer memory (not counted twice); the staging rows came on top
    w, dw = workspace_bytes(spec), workspace_bytes(dspec)
    assert dw["total"] >= w["total"] + 2048 * (2 * SHAPE.hidden + 4)
    assert workspace_bytes(pushed)["backward"] == w["backward"] - 2048 * 2 * SHAPE.hidden


def test_bwd_dir_peers_struct_packs_one_pointer_per_rank():
    import struct

    offsets, size = abi.layout(abi.BWD_DIR_PEERS, ranks=4)
    assert offsets == {"xflags": 0, "ring_dy": 32, "table": 64, "meta": 96, "stage": 128,
                       "stage_dw": 160}
    assert size == 192
    raw = abi.pack(abi.BWD_DIR_PEERS, ranks=2, xflags=[1, 2], ring_dy=[3, 4], table=[5, 6],
                   meta=[7, 8], stage=[None, 9], stage_dw=[10, 11])
    assert struct.unpack("<12Q", raw) == (1, 2, 3, 4, 5, 6, 7, 8, 0, 9, 10, 11)
    assert "push-reverse-combine" in abi.phase_text(8) and "every owner" in abi.phase_text(9)
    assert "pull-reverse-dispatch" in abi.phase_text(10)
    assert "pull reverse-dispatch" in abi.phase_text(20)
    numbers = [v for v, _ in abi.PHASES.values()]
    assert len(numbers) == len(set(numbers))  # no two waits share a watchdog phase


@pytest.mark.parametrize("reverse_combine,reverse_dispatch,dtype",
                         [("push", "push", "bf16"), ("pull", "pull", "bf16"),
                          ("push", "pull", "bf16"), ("pull", "pull", "mxfp8"),
                          ("pull", "pull", "fp8")])
def test_backward_direction_kernels_compile_without_spills(reverse_combine, reverse_dispatch,
                                                           dtype):
    """nvcc builds every backward variant for sm_90a (the CPU suite's compile check)."""
    p = mokgen.plan(SHAPE, ep=4, tokens_per_rank=512, dtype=dtype,
                    reverse_combine=reverse_combine, reverse_dispatch=reverse_dispatch)
    (b,) = build.build(codegen.emit(p, units=("bwd",)), arch=p.arch)
    res = b.resources["mokgen_bwd"]
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0, res


def test_prebuild_covers_the_multigpu_direction_tests():
    """benchmarks/prebuild.py multigpu builds the layers tests/test_multigpu.py's direction
    tests compile (gpu-small, 700 tokens, a wrapping ring), each direction of each pass."""
    from benchmark_scripts import load

    from mokgen.harness.workloads import backward_direction_layers, direction_layers

    pinned = dict(minibatch=128, macrobatch=256)
    want = [mokgen.plan(SHAPE, **kw) for kws in (direction_layers(SHAPE, 2, 700, **pinned),
                                                  backward_direction_layers(SHAPE, 2, 700,
                                                                            **pinned))
            for kw in kws.values()]
    got = {p.key() for p in load("prebuild").multigpu_test_plans(2)}
    assert {p.key() for p in want} <= got
    assert {(p.reverse_combine, p.reverse_dispatch) for p in want} == set(BACKWARD)
    assert {(p.dispatch, p.combine) for p in want} == set(FORWARD)
