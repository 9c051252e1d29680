"""benchmarks/fill_bench: its kernel compiles without spills, and the host's expected stage
(what the check compares the GPU's copy with) is the 128B-swizzled layout of the rows named."""
import shutil

import pytest
import torch

from benchmark_scripts import load


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_fill_bench_compiles_without_spills(tmp_path):
    log = load("fill_bench").build(str(tmp_path / "fill_bench.cubin"))
    assert "0 bytes spill stores, 0 bytes spill loads" in log, log[-800:]


@pytest.mark.parametrize("mode,boxes", [(0, 4), (2, 4), (0, 2), (7, 2), (6, 4)])
def test_expected_slice_is_the_swizzled_rows(mode, boxes):
    fb = load("fill_bench")
    g = torch.Generator().manual_seed(1)
    src = torch.randn(fb.T, fb.D, generator=g).to(torch.bfloat16)
    table = torch.randint(0, fb.T, (fb.T * fb.K,), generator=g, dtype=torch.int32)
    s = 37
    got = fb.expected_slice(src, table, mode, boxes, s).view(boxes, fb.ROWS, 8, 16)
    col0 = (s % (fb.D // (64 * boxes))) * 64 * boxes
    for r in (0, 5, 63):
        tok = (s * fb.ROWS) % fb.T + r if mode in (2, 7) else int(table[s * fb.ROWS + r])
        row = src[tok, col0:col0 + 64 * boxes].contiguous().view(torch.uint8).view(boxes, 8, 16)
        for c in range(8):  # chunk c of row r at c ^ (r & 7), box by box
            assert torch.equal(got[:, r, c ^ (r & 7)], row[:, c])
