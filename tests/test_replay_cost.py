"""benchmarks/replay_cost.py's split of a step's GPU time (no GPU): kernels overlapping in time
are busy once, mokgen's own kernels apart, everything per layer."""
import pytest

from benchmark_scripts import load


def test_kernel_split_counts_overlapping_kernels_once_per_layer():
    rc = load("replay_cost")
    kernels = [("mokgen_fwd", 0.0, 1000.0), ("elementwise", 500.0, 100.0),  # inside the first
               ("gemm", 4500.0, 500.0), ("mokgen_bwd", 2000.0, 2000.0)]  # (out of order)
    split = rc.kernel_split(kernels, gpu_ms=6.0, L=2)
    assert split == pytest.approx(dict(gpu_ms_per_layer=3.0, kernels_ms_per_layer=1.8,
                                       mokgen_kernels_ms_per_layer=1.5, busy_ms_per_layer=1.75))
    assert rc.kernel_split([], gpu_ms=1.0, L=1)["busy_ms_per_layer"] == 0.0


def test_kernel_table_groups_by_whole_name_and_keeps_the_tail():
    rc = load("replay_cost")
    # two GEMMs whose names differ only past the 40th character (as CuTe DSL's do)
    a, b = "quackgemm_" + "x" * 80 + "_dgrad", "quackgemm_" + "x" * 80 + "_wgrad"
    kernels = [(a, 0.0, 300.0), (b, 300.0, 500.0), (a, 900.0, 100.0), ("small", 1000.0, 10.0)]
    table = rc.kernel_table(kernels, L=2, n=2)
    assert [t[0][-6:] for t in table] == ["_wgrad", "_dgrad"]
    assert table[0][1:] == pytest.approx([0.25, 0.5])
    assert table[1][1:] == pytest.approx([0.2, 1.0])
    assert all(len(t[0]) <= 72 for t in table)
    seq = rc.kernel_sequence(kernels)  # launch order, the 10 us kernel left out
    assert [(s[0][-6:], s[1]) for s in seq] == [("_dgrad", 0.0), ("_wgrad", 300.0),
                                                ("_dgrad", 900.0)]
