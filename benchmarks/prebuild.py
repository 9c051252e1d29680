"""Compile ahead every kernel the multi-GPU run needs (no GPU: nvcc only, in parallel):

    MOKGEN_CACHE=$PWD/.mokgen-cache python benchmarks/prebuild.py --world 2

tests/test_multigpu.py's layers, benchmarks/multigpu.py's and benchmarks/fsdp_overlap.py's
(their default arguments), and examples/04_train_fsdp_ep.py's. Kernels already in
$MOKGEN_CACHE are kept (the cache key covers source, headers, flags and nvcc version), so
this is cheap where a carried cache matches.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import mokgen  # noqa: E402
from mokgen.pytorch.api import build_plans  # noqa: E402


def test_plans(R: int) -> list:
    """The layers tests/test_multigpu.py compiles (keep in step with it)."""
    s = mokgen.shapes.get("gpu-small")
    return [mokgen.plan(s, ep=R, tokens_per_rank=n) for n in (513, 700, 256)] + \
        [mokgen.plan(s, ep=R, tokens_per_rank=700, reserve_sms=16)]


def example_plans(R: int) -> list:
    """examples/04_train_fsdp_ep.py's layers (--moe mokgen, default sizes, with and without
    overlap_comm)."""
    s, tokens = mokgen.MoEShape(16, 512, 256, 2, name="lm"), 8 * 128
    return [mokgen.plan(s, ep=R, tokens_per_rank=tokens, **kw)
            for kw in ({}, {"overlap_comm": True})]


def main(argv=None) -> int:
    import fsdp_overlap
    import multigpu

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--tokens", default=None, help="multigpu.py's --tokens (default: its own)")
    ap.add_argument("--skip-bench", action="store_true", help="the tests' kernels only")
    args = ap.parse_args(argv)
    R = args.world
    plans = test_plans(R) + example_plans(R)
    if not args.skip_bench:
        bench_args = multigpu.parse(["--tokens", args.tokens] if args.tokens else [])
        plans += multigpu.plans(bench_args, R)
        plans += fsdp_overlap.plans(fsdp_overlap.parse([]), R)
    t0 = time.perf_counter()
    bins = build_plans(plans, jobs=args.jobs)
    built = sum(not b.cached for b in bins)
    print(f"prebuild: {len(plans)} plans, {len(bins)} kernels ({built} built, "
          f"{len(bins) - built} cached) in {time.perf_counter() - t0:.0f} s "
          f"-> {mokgen.config.CONFIG.cache}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
