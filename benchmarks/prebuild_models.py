"""Compile ahead, here (nvcc, no GPU), the kernels benchmarks/models.py runs for some models,
so a device call spends no time in nvcc (ab_models.sh's step "each tree's kernels into its
cache"). Run it from the tree whose kernels you want, with that tree's cache:

    MOKGEN_CACHE=.build/kc python benchmarks/prebuild_models.py MODEL,MODEL... [EP] [TOKENS]
        [GEMM_BWD]   (as models.py --gemm-bwd, e.g. 128x256x4-solo)
    (cd .build/ab/NAME && MOKGEN_CACHE=$PWD/kc python benchmarks/prebuild_models.py ...)

It imports the mokgen of the tree it sits in (its own parent folder), not the installed one.

Kernels already in the cache are kept (the cache key covers source, headers and flags).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mokgen  # noqa: E402
from mokgen.pytorch.api import build_plans  # noqa: E402
from mokgen.cli import _gemm  # noqa: E402
from mokgen.harness.tune import tuned_plan  # noqa: E402


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: prebuild_models.py MODEL,MODEL... [EP] [TOKENS] [GEMM_BWD]",
              file=sys.stderr)
        return 2
    models, ep = argv[0].split(","), int(argv[1]) if len(argv) > 1 else 1
    tokens = int(argv[2]) if len(argv) > 2 else 4096
    over = dict(gemm_bwd=_gemm(argv[3])) if len(argv) > 3 else {}
    for name in models:
        t0 = time.perf_counter()
        plan = tuned_plan(mokgen.shapes.get(name), ep, "bf16", tokens, **over)  # as compile
        build_plans([plan])
        print(f"{name} ep {ep} N {tokens}: {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
