"""bench and tune: argument handling without a GPU, and compile's use of tuned winners."""
import json

import pytest

import mokgen
from mokgen.compiler import tuned
from mokgen.harness import tune
from mokgen.cli import main

from conftest import kernels_not_built


@pytest.mark.parametrize("argv,err", [
    (["tune", "--shape", "nope"], "unknown shape preset"),
    (["tune", "--shape", "tiny", "--ep", "3"], "ep must divide"),
    (["tune", "--shape", "tiny", "--ep", "2", "--iters", "0"], "iters"),
    (["tune", "--shape", "tiny", "--ep", "2", "--dtype", "fp4"], "dtype"),
    (["bench", "--tokens", "12,x"], "--tokens must be a comma-separated list"),
    (["bench", "--ep", "-8"], "--ep must be positive"),
    (["bench", "--shapes", "kimi-k2.7,nope"], "unknown shape preset"),
    (["bench", "--shapes", "tiny", "--ep", "2", "--minibatch", "100"], "minibatch"),
])
def test_tool_arguments_are_checked(capsys, argv, err):
    assert main(argv) == 2
    assert err in capsys.readouterr().err


def test_tools_say_they_need_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert main(["bench", "--shapes", "tiny", "--ep", "2", "--tokens", "64"]) == 2
    assert main(["tune", "--shape", "tiny", "--ep", "2", "--tokens", "64"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_candidates_are_valid_plans_around_the_model_choice():
    base = mokgen.plan(mokgen.shapes.get("kimi-k2.7"), ep=64, tokens_per_rank=2048)
    cands = tune.candidates(base)
    assert any((p.minibatch, p.comm_sms_fwd) == (base.minibatch, base.comm_sms_fwd) for p in cands)
    assert len({(p.minibatch, p.comm_sms_fwd) for p in cands}) == len(cands) >= 9
    assert {p.minibatch for p in cands} == {640, 1408, 2816}
    assert all(p.minibatch % 128 == 0 and p.macrobatch >= 2 * p.minibatch for p in cands)


def test_backward_candidates_move_only_the_backward_comm_sms():
    base = mokgen.plan(mokgen.shapes.get("kimi-k2.7"), ep=64, tokens_per_rank=2048)
    cands = tune.backward_candidates(base)
    assert base.comm_sms_bwd in {p.comm_sms_bwd for p in cands}
    assert len({p.comm_sms_bwd for p in cands}) == len(cands) >= 3
    assert all((p.minibatch, p.comm_sms_fwd) == (base.minibatch, base.comm_sms_fwd)
               for p in cands)


def test_compile_uses_a_stored_winner_unless_overridden(tmp_path, monkeypatch):
    monkeypatch.setattr(tuned, "CONFIG", tuned.CONFIG.__class__(
        **{**tuned.CONFIG.__dict__, "cache": tmp_path}))
    shape = mokgen.shapes.get("gpu-small")
    assert tuned.load_tuned(shape, 2, "bf16", 512) == {}
    path = tuned.tuned_file(shape, 2, "bf16", 512)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"best": {"minibatch": 256, "comm_sms_fwd": 9,
                                         "measured_ms": 1.0}}))
    assert tuned.load_tuned(shape, 2, "bf16", 512) == {"minibatch": 256, "comm_sms_fwd": 9}
    best = {"minibatch": 256, "comm_sms_fwd": 9, "comm_sms_bwd": 5, "measured_ms": 1.0}
    path.write_text(json.dumps({"best": best}))
    assert tuned.load_tuned(shape, 2, "bf16", 512) == {"minibatch": 256, "comm_sms_fwd": 9,
                                                      "comm_sms_bwd": 5}
    # gathered rows (one rank) run no comm CTAs: a result tuned for copied rows stays out
    one = tuned.tuned_file(shape, 1, "bf16", 512)
    one.write_text(json.dumps({"best": best}))
    assert tuned.tuned_plan(shape, 1, "bf16", 512).comm_sms_fwd == 9
    # a keep_h plan (one rank, bf16: the default) takes no tuned backward comm SMs: its two
    # backward kernels (resident twin, x-pulling) want different counts; keep_h=False does
    kept, plain = (tuned.tuned_plan(shape, 1, "bf16", 512, **kw) for kw in ({}, {"keep_h": False}))
    assert kept.keep_h and kept.comm_sms_bwd != 5 and not kept.is_forced("comm_sms_bwd")
    assert not plain.keep_h and plain.comm_sms_bwd == 5
    g = tuned.tuned_plan(shape, 1, "bf16", 512, dispatch="gather")
    assert (g.dispatch, g.comm_sms_fwd, g.comm_sms_bwd) == ("gather", 0, 0)
    with kernels_not_built():  # what is compiled is the plan's business, checked here
        layer = mokgen.compile(shape, ep=2, tokens_per_rank=512)
        assert (layer.plan.minibatch, layer.plan.comm_sms_fwd, layer.plan.comm_sms_bwd) == \
            (256, 9, 5)
        layer = mokgen.compile(shape, ep=2, tokens_per_rank=512, minibatch=128)
    assert layer.plan.minibatch == 128 and layer.plan.comm_sms_fwd != 9
    path.write_text("{broken")
    assert tuned.load_tuned(shape, 2, "bf16", 512) == {}


def test_gemm_flags_name_the_config_fields():
    """--gemm / --gemm-bwd's BMxBNxSTAGES[-flag]: each flag sets its GemmConfig field alone."""
    import argparse

    from mokgen.cli import _gemm
    from mokgen.compiler.ir.ops import GemmConfig
    assert GemmConfig(*_gemm("128x256x4")) == GemmConfig(128, 256, 4)
    for flag, field in (("pair", "pair"),):
        cfg = GemmConfig(*_gemm(f"128x256x3-{flag}"))
        assert cfg.stages == 3 and [f for f in cfg._fields[3:] if getattr(cfg, f)] == [field]
    for flag in ("twin", "pp", "sw", "solo"):  # no such schedules
        with pytest.raises(argparse.ArgumentTypeError, match="pair"):
            _gemm(f"128x256x4-{flag}")
