"""benchmarks/torchtitan_train.py without a GPU: its data windows and its report's band
arithmetic (the training itself runs on the GPU machine)."""
import json

import pytest
import torch

from benchmark_scripts import load

bench = load("torchtitan_train")


def test_windows_are_consecutive_text_with_labels_one_token_ahead():
    tokens = torch.arange(100)
    data = bench.batches(tokens, batch=3, seq=8, seed=5)
    seen = []
    for _ in range(6):  # 6 * 3 * 8 = 144 tokens: wraps around the 100
        x, y = next(data)
        assert x.shape == y.shape == (3, 8)
        assert torch.equal(y[:, :-1], x[:, 1:])
        assert torch.equal((x[:, 1:] - x[:, :-1]) % 100, torch.ones(3, 7, dtype=torch.int64))
        seen.append(x[:, 0])
    starts = torch.cat(seen)
    assert torch.equal((starts[1:] - starts[:-1]) % 100, torch.full((17,), 8))
    other = next(bench.batches(tokens, batch=3, seq=8, seed=6))[0]
    assert not torch.equal(other, next(bench.batches(tokens, batch=3, seq=8, seed=5))[0])


def _run(path, impl, seed, loss, dtype="bf16"):
    run = {"model": "debug", "impl": impl, "dtype": dtype, "seed": seed, "loss": loss,
           "steps_done": len(loss), "tokens_per_s": 1000.0 + seed, "peak_mb": 10.0 * (seed + 1),
           "layers": 8, "config": {}, "gpu": "test", "commit": "test"}
    (path / f"debug_{bench.label(run)}_s{seed}.json").write_text(json.dumps(run))


def test_report_band_counts_the_steps_inside_the_seeds_range(tmp_path):
    runs, results = tmp_path / "runs", tmp_path / "results"
    runs.mkdir()
    for seed, level in ((0, 1.0), (1, 2.0), (2, 3.0)):
        _run(runs, "torchtitan", seed, [level] * 10)
    _run(runs, "mokgen", 0, [2.5] * 6 + [3.5] * 4)  # inside for 6 steps, then 0.5 above
    _run(runs, "mokgen", 0, [0.5] * 10, dtype="mxfp8")
    assert bench.main(["report", "--model", "debug", "--smooth", "1", "--results",
                       str(results), str(runs)]) == 0
    out = json.loads((results / "torchtitan_debug.json").read_text())
    assert out["band"]["mokgen_s0"] == pytest.approx({"inside_fraction": 0.6,
                                                      "worst_excursion": 0.5})
    assert out["band"]["mokgen-mxfp8_s0"] == pytest.approx({"inside_fraction": 0.0,
                                                            "worst_excursion": 0.5})
    tt = out["implementations"]["torchtitan"]
    assert tt["seeds"] == [0, 1, 2] and tt["peak_mb"]["2"] == 30.0
    assert out["implementations"]["mokgen"]["loss"]["0"][-1] == 3.5


def test_smoothing_is_a_trailing_mean():
    assert bench.smooth([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
