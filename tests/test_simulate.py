"""The deployment simulator (mokgen.harness.simulate) and its command: pure CPU."""
import json
from pathlib import Path

import pytest

import mokgen
from mokgen.compiler import codegen
from mokgen.harness import simulate
from mokgen.cli import main

KIMI = mokgen.shapes.get("kimi-k2.7")
# measured rows (one H200) in the results' form simulate.validate reads: a fixture, so the
# test does not move when the benchmarks' results do
RESULTS = str(Path(__file__).parent / "data" / "simulate_results")


def test_predictions_follow_the_links():
    h = {ep: simulate.predict(KIMI, ep, 4096, "h200-nvl8") for ep in (8, 16, 64)}
    g = {ep: simulate.predict(KIMI, ep, 4096, "gb200-nvl72") for ep in (8, 16, 64)}
    assert not h[8]["crosses_domain"] and h[16]["crosses_domain"]
    assert not g[64]["crosses_domain"]  # one NVL72 domain
    # past the NVLink domain the rows cross 50 GB/s NICs: comm-bound, slower than inside
    assert h[16]["fwd_comm_ms"] > 2 * h[8]["fwd_comm_ms"] and h[64]["fwd_bound"] == "comm"
    for ep in (8, 16, 64):
        p = h[ep]
        assert 0 < p["fwd_ms"] < p["train_ms"] and p["train_ms"] == p["fwd_ms"] + p["bwd_ms"]
        assert g[ep]["train_ms"] < h[ep]["train_ms"]
        assert p["fwd_ms"] >= max(p["fwd_comm_ms"], p["fwd_compute_ms"])


def test_plans_for_other_gpus_are_simulated_never_built():
    p = mokgen.plan(KIMI, ep=64, arch="GB200")
    assert (p.gpu, p.arch, p.num_sms) == ("GB200", "sm_100a", 148)
    with pytest.raises(ValueError, match="sm_90a"):
        codegen.emit(p)


def test_a_rank_load_and_the_single_gpu_slice():
    two = simulate.predict(KIMI, 2, 2048, "h200-nvl8", local_experts=6)
    assert two["local_experts"] == 6 and two["ep"] == 2
    one = simulate.predict(KIMI, 64, 2048, "h200-1gpu")
    assert one["local_experts"] == 6 and not one["crosses_domain"]


def test_validation_against_the_committed_slices():
    """The calibration (K_FIXED, EFFICIENCY) came from the ep=64 slices; the ep=8 slices are
    out of sample. Guard the model's error where it was measured."""
    rows = simulate.validate(RESULTS)
    assert len([r for r in rows if r["ep"] == 8]) >= 24
    for what in ("fwd", "bwd"):
        errs = [abs(r["error"]) for r in rows if r["what"] == what]
        assert sum(errs) / len(errs) < 0.15, what
    assert "mean |error| fwd" in simulate.validation_table(rows)


def test_cli_simulate(capsys):
    assert main(["simulate", "--shape", "glm-5.2", "--ep", "8,16", "--system",
                 "gb200-nvl72"]) == 0
    out = capsys.readouterr().out
    assert "gb200-nvl72" in out and "bwd ms" in out
    assert main(["simulate", "--shape", "glm-5.2", "--ep", "8", "--json", "--overlap-comm"]) == 0
    (p,) = json.loads(capsys.readouterr().out)
    assert p["num_sms"] == 116
    assert main(["simulate", "--shape", "glm-5.2", "--system", "tpu"]) == 2
    assert "system must be one of" in capsys.readouterr().err
    assert main(["simulate", "--shape", "glm-5.2", "--ep", "3"]) == 2
    assert main(["simulate", "--validate", "--results", RESULTS]) == 0
    assert "measured" in capsys.readouterr().out
