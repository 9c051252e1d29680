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
