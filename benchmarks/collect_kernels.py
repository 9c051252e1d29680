"""Which kernels the GPU tests build, found without building them, and a parallel build of
that list where many cores are (the GPU machine), so the tests then find every kernel built.

1. Collect (any machine; a pytest plugin): the GPU tests run with their skips lifted until
   their first kernel build, which records the plans being compiled and stops the test there:
       python -m pytest -p benchmarks.collect_kernels -m gpu tests/ --collect-out P.pkl
   (each test records its first layer's plan; later layers of a test build as it runs).
   On a machine without a GPU the tests' CPU-side preparation runs for real (~10 min).
   Plans, not sources, are kept: a header or ABI change since leaves the list valid.
2. Build (the GPU machine, nvcc on every core): the plans' kernels as the tree now emits them
       MOKGEN_CACHE=... python benchmarks/collect_kernels.py P.pkl [--bench "ARGS"]
   --bench adds the layers `python -m mokgen bench ARGS` would run, so a benchmark in the same
   call finds its kernels built too.
"""
from __future__ import annotations

import os
import pickle
import sys
import time

import pytest

_PLANS: dict = {}


class Collected(Exception):
    """Raised in place of a build: the test has shown what it would build."""


def pytest_addoption(parser):
    parser.addoption("--collect-out", default="collected_kernels.pkl")


def pytest_configure(config):
    from mokgen.compiler import build, codegen
    emit = codegen.emit

    def record_plan(plan, *args, **kwargs):
        _PLANS[plan.key()] = plan
        return emit(plan, *args, **kwargs)

    def stop(kernels, *args, **kwargs):
        raise Collected()

    codegen.emit, build.build = record_plan, stop


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    for item in items:  # after conftest's "no GPU" skips: lift them
        item.own_markers[:] = [m for m in item.own_markers if m.name != "skip"]


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--collect-out")
    with open(path, "wb") as f:
        pickle.dump(list(_PLANS.values()), f)
    print(f"\ncollect_kernels: {len(_PLANS)} plans -> {path}")


def bench_plans(argv: list) -> list:
    """The plans `python -m mokgen bench argv` runs (its own parser and validation)."""
    import mokgen
    from mokgen.harness import bench
    from mokgen.compiler.tuned import tuned_plan
    return [tuned_plan(mokgen.shapes.get(name), ep, "bf16", n, **ov)
            for name, ep, n, ov in bench._configs(bench.parser().parse_args(argv))]


def main(argv: list) -> int:
    import shlex
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from mokgen.pytorch.api import build_plans
    path = argv[0]
    with open(path, "rb") as f:
        plans = pickle.load(f)
    if len(argv) > 2 and argv[1] == "--bench":
        plans += bench_plans(shlex.split(argv[2]))
    t0 = time.perf_counter()
    bins = build_plans(plans, jobs=os.cpu_count())
    print(f"collect_kernels: {len(bins)} kernels ({sum(not b.cached for b in bins)} built) in "
          f"{time.perf_counter() - t0:.0f} s, spills {sum(b.spills for b in bins)}, "
          f"wgmma serialized in {sum(bool(b.serialized) for b in bins)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
