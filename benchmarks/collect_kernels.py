"""Which kernels the GPU tests build, found without building them, and a parallel build of
that list where many cores are (the GPU machine), so the tests then find every kernel built.

1. Collect (any machine; a pytest plugin): the GPU tests run with their skips lifted until
   their first kernel build, which records the kernels and stops the test there:
       python -m pytest -p benchmarks.collect_kernels -m gpu tests/ --collect-out K.pkl
   (each test records its first layer's kernels; later layers of a test build as it runs).
   On a machine without a GPU the tests' CPU-side preparation runs for real (~10 min).
2. Build (the GPU machine, nvcc on every core):
       MOKGEN_CACHE=... python benchmarks/collect_kernels.py K.pkl
"""
from __future__ import annotations

import os
import pickle
import sys
import time

import pytest

_KERNELS: dict = {}


class Collected(Exception):
    """Raised in place of a build: the test has shown what it would build."""


def pytest_addoption(parser):
    parser.addoption("--collect-out", default="collected_kernels.pkl")


def pytest_configure(config):
    from mokgen import build

    def record(kernels, *args, **kwargs):
        for k in kernels:
            _KERNELS[k.name] = k
        raise Collected()

    build.build = record


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    for item in items:  # after conftest's "no GPU" skips: lift them
        item.own_markers[:] = [m for m in item.own_markers if m.name != "skip"]


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--collect-out")
    with open(path, "wb") as f:
        pickle.dump(list(_KERNELS.values()), f)
    print(f"\ncollect_kernels: {len(_KERNELS)} kernels -> {path}")


def main(path: str) -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from mokgen import build
    with open(path, "rb") as f:
        kernels = pickle.load(f)
    t0 = time.perf_counter()
    bins = build.build(kernels, jobs=os.cpu_count())
    print(f"collect_kernels: {len(bins)} kernels ({sum(not b.cached for b in bins)} built) in "
          f"{time.perf_counter() - t0:.0f} s, spills {sum(b.spills for b in bins)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
