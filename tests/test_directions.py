"""The communication directions (CPU): every plan moves rows the paper's way (pull dispatch,
push combine, pull reverse-combine, push reverse-dispatch), or moves none (gathered rows, dx
rows in the ring) where asked or where a direction has no comm CTAs; other values are
refused naming the ones allowed. GPU checks: every test_gpu_* file, test_multigpu.py."""
import json
import re

import pytest

import mokgen
from mokgen.compiler import limits

SHAPE = mokgen.shapes.get("gpu-small")
PAPER = ("pull", "push", "pull", "push")  # dispatch, combine, reverse_combine, reverse_dispatch


def directions(p) -> tuple:
    return p.dispatch, p.combine, p.reverse_combine, p.reverse_dispatch


@pytest.mark.parametrize("gpu", ["h100-sxm", "h200", "h800", "h100-pcie", "h20"])
def test_every_planned_layer_moves_rows_the_paper_s_way(gpu):
    for name, ep, dtype, tokens in (("kimi-k2.7", 64, "bf16", 2048), ("kimi-k2.7", 8, "fp8", 4096),
                                    ("qwen3-30b-a3b", 4, "mxfp8", 8192),
                                    ("mixtral-8x7b", 2, "bf16", 512)):
        p = mokgen.plan(mokgen.shapes.get(name), ep=ep, dtype=dtype, tokens_per_rank=tokens,
                        gpu=gpu)
        assert directions(p) == PAPER, (name, ep, dtype, gpu)
        assert "dispatch=pull combine=push" in str(p)
    # one rank: dx rows stay in a ring that holds every minibatch (passes/dx_rows.py)
    p = mokgen.plan(mokgen.shapes.get("qwen3-30b-a3b"), ep=1, tokens_per_rank=8192, gpu=gpu)
    assert directions(p)[:3] == PAPER[:3] and p.reverse_dispatch in ("push", limits.RING)


def test_rows_that_do_not_move_where_asked_or_without_comm_ctas():
    p = mokgen.plan(SHAPE, ep=1, tokens_per_rank=1024, dispatch=limits.GATHER)
    assert p.dispatch == limits.GATHER and p.comm_sms_fwd == 0
    both = mokgen.plan(SHAPE, ep=1, tokens_per_rank=1024, comm_sms_fwd=0, comm_sms_bwd=0)
    assert (both.dispatch, both.reverse_combine) == (limits.GATHER, limits.GATHER)
    assert (both.combine, both.reverse_dispatch) == ("push", "push")


@pytest.mark.parametrize("op,value", [("dispatch", "push"), ("combine", "pull"),
                                      ("reverse_combine", "push"), ("reverse_dispatch", "pull"),
                                      ("combine", limits.GATHER), ("dispatch", limits.RING)])
def test_other_directions_are_refused_naming_the_allowed_ones(op, value):
    with pytest.raises(ValueError, match=re.escape(f"{op} must be one of {limits.directions(op)}")):
        mokgen.plan(SHAPE, ep=2, tokens_per_rank=1024, **{op: value})


def test_a_plan_written_with_signals_still_loads():
    """Plans serialized while the directions were a choice carry a `signals` table."""
    p = mokgen.plan(SHAPE, ep=2, tokens_per_rank=1024)
    old = dict(json.loads(p.to_json()), signals=[["dispatch", "pull", 1, 0]])
    assert mokgen.Plan.from_json(json.dumps(old)).key() == p.key()
