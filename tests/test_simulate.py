"""The deployment simulator (mokgen.harness.simulate) and its command: pure CPU."""
import json
from pathlib import Path

import pytest

import mokgen
from mokgen.compiler import codegen
from mokgen.harness import simulate
from mokgen.cli import main

KIMI = mokgen.shapes.get("kimi-k2.7")
# measured rows in the benchmarks' result form (benchmarks/result_file.py: moe_layer.json and
# multigpu.json, each row naming its GPU and commit): the H200 rows of one layer run and one
# two-GPU run, beside a few synthetic rows of another GPU that validate must skip. A fixture,
# so the test does not move when the benchmarks' results do.
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
    out of sample. Guard the model's error where it was measured, on the H200 rows only."""
    rows = simulate.validate(RESULTS)
    layer = [r for r in rows if r["source"].startswith("moe_layer")]
    multi = [r for r in rows if r["source"].startswith("multigpu")]
    fp8 = [r for r in rows if r["source"].startswith("fp8")]
    # 24 H200 slices, forward and backward; 8 fp8 slices, forward and backward; 8 two-GPU
    # rows, forward and training step
    assert len(layer) == 48 and len(fp8) == 16 and len(multi) == 16 and len(rows) == 80
    assert {r["source"] for r in rows} == {"moe_layer 0e2a036", "fp8 38c569e",
                                           "multigpu 1f4c34c"}
    assert len([r for r in layer if r["ep"] == 8]) == 24
    for what in ("fwd", "bwd"):
        errs = [abs(r["error"]) for r in layer if r["what"] == what]
        assert sum(errs) / len(errs) < 0.15, what
    for what in ("fwd", "train"):
        errs = [abs(r["error"]) for r in multi if r["what"] == what]
        assert sum(errs) / len(errs) < 0.25, what
    # fp8: the weight gradients and the shared expert at the bf16 rate (the backward was
    # predicted ~40% short while all its GEMMs ran at the fp8 rate)
    for what, bound in (("fwd8", 0.2), ("bwd8", 0.15)):
        errs = [abs(r["error"]) for r in fp8 if r["what"] == what]
        assert sum(errs) / len(errs) < bound, what
    assert "mean |error| fwd" in simulate.validation_table(rows)


def test_validation_reads_each_gpus_rows_and_missing_files(tmp_path):
    """Rows of a GPU the systems do not model are skipped, not compared; an absent file has
    no rows."""
    data = json.loads((Path(RESULTS) / "moe_layer.json").read_text())
    data["rows"] = [r for r in data["rows"] if "H200" not in r["gpu"]]
    assert data["rows"]  # the fixture's other GPU
    (tmp_path / "moe_layer.json").write_text(json.dumps(data))
    assert simulate.validate(tmp_path) == []
    assert simulate.validate(tmp_path / "absent") == []


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
