"""lab/gather_ab.py: a variant spec's plan overrides (what each A/B side is built with; not
in CI: lab/ is not tests/)."""
import importlib.util
import pathlib

import pytest


def load(name: str):
    """lab/NAME.py as a module (lab/ is not a package; run from the repository root:
    python -m pytest -p no:cacheprovider lab/)."""
    path = pathlib.Path(__file__).parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"lab_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_variant_specs_force_plan_fields():
    v = load("gather_ab").variant
    assert v("pull") == dict(dispatch="pull", reverse_combine="pull")
    assert v("fwd-gather+comm_sms_bwd=8") == dict(dispatch="gather", reverse_combine="pull",
                                                   comm_sms_bwd=8)
    assert v("pull+keep_h=true+x_slots=-1")["keep_h"] is True
    assert v("pull+keep_h=true+x_slots=-1")["x_slots"] == -1
    # a tuple field (GemmConfig): colon-separated, as the --variants list is comma-separated
    assert v("pull+gemm_fwd=128:256:3")["gemm_fwd"] == (128, 256, 3)
    assert v("gather+gemm_bwd=128:256:4:false:false:true")["gemm_bwd"] == \
        (128, 256, 4, False, False, True)
    with pytest.raises(KeyError):
        v("nonesuch")


def test_sustained_columns_average_the_two_runs(monkeypatch, tmp_path):
    """--sustained: each variant's back-to-back forward and step times (measure's extra) from
    its two mirrored runs become one TFLOP/s column each: the mean of the two runs' ms."""
    import json
    g = load("gather_ab")
    runs = {"pull": iter([2.0, 4.0]), "gather": iter([3.0, 3.0])}

    def fake_measure(make, T, D, iters, sustained=0.0, extra=None):
        v = make()
        ms = next(runs[v])
        assert sustained == 1.5 and extra is not None
        extra.update(fwd_sustained_ms=ms, train_sustained_ms=2 * ms)
        return 1.0, 2.0, 10.0, 2.0, 10.0

    def fake_layer(D, I, E, k, T, **over):
        return "gather" if over.get("dispatch") == "gather" and "reverse_combine" not in over \
            else "pull"

    monkeypatch.setattr(g, "measure", fake_measure)
    monkeypatch.setattr(g, "layer", fake_layer)
    monkeypatch.setattr(g.torch.cuda, "get_device_name", lambda *a: "fake")
    assert g.main(["--out", str(tmp_path), "--shapes", "qwen3-30b-a3b", "--variants",
                   "pull,gather", "--sustained", "1.5"]) == 0
    row = json.load(open(tmp_path / "gather_ab.json"))["rows"][0]
    flops = 6 * row["T"] * row["k"] * row["D"] * row["I"]
    assert abs(row["pull_fwd_sustained_tflops"] - flops / 3.0 / 1e9) < 1e-6  # mean(2, 4)
    assert abs(row["pull_train_sustained_tflops"] - 3 * flops / 6.0 / 1e9) < 1e-6
    assert abs(row["gather_fwd_sustained_tflops"] - flops / 3.0 / 1e9) < 1e-6
