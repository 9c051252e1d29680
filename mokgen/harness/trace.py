"""The `trace` profile's buffer (Plan.profile "trace", runtime/include/mokgen/trace.cuh): a
record per task of a traced kernel, with its clocks, read back after one run."""
from __future__ import annotations

import struct

import torch

from mokgen.runtime import abi, cuda


def traced(modules, ctas: int, run) -> list:
    """run() once with the `mokgen_trace` global of the module (or of each of a sequence: a
    keep_h backward's two kernels, one of which runs) pointing at a zeroed buffer; returns its
    records [ctas][TRACE_RECS][TRACE_WORDS] (rows of tasks not run are zero). The global is
    reset to null afterwards, so the module runs untraced again."""
    modules = modules if isinstance(modules, (tuple, list)) else (modules,)
    buf = torch.zeros(ctas * abi.TRACE_RECS * abi.TRACE_WORDS, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    for m in modules:
        cuda.set_global(m, "mokgen_trace", struct.pack("<Q", buf.data_ptr()))
    try:
        run()
        torch.cuda.synchronize()
    finally:
        for m in modules:
            cuda.set_global(m, "mokgen_trace", struct.pack("<Q", 0))
    return buf.view(ctas, abi.TRACE_RECS, abi.TRACE_WORDS).cpu().tolist()
