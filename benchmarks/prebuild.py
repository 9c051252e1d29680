"""Compile ahead, on a machine with nvcc and no GPU, the kernels a GPU call will load, so the
call spends its minutes measuring rather than in nvcc. Kernels already in $MOKGEN_CACHE are
kept (the cache key covers source, headers, flags and nvcc version), so this is cheap where a
carried cache matches; point MOKGEN_CACHE inside the checkout (e.g. $PWD/.kcache, ignored by
git) to carry the result.

    python benchmarks/prebuild.py collect PLANS.pkl [TEST_FILE ...]
        which kernels the GPU tests build, found without building them (their CPU-side
        preparation runs for real, ~6-10 min here): the tests run with their "no GPU" skips
        lifted until their first kernel build, which records the plan and stops the test.
        Plans, not sources, are kept: a header or ABI change since leaves the list valid.
        (pytest then reports every test as failed: each was stopped at its first build.)
    python benchmarks/prebuild.py build [PLANS.pkl] [--bench "MOKGEN BENCH ARGS"]
        the listed plans' kernels as the tree emits them now, on every core (the GPU machine:
        benchmarks/run_gpu.sh runs this before the tests); --bench adds the layers
        `python -m mokgen bench ARGS` (benchmarks/moe_layer.py) runs.
    python benchmarks/prebuild.py layers PRESET,PRESET... [--ep 1,8] [--tokens 4096]
            [--dtypes bf16,fp8,mxfp8] [--gemm-bwd T]
        the layers mokgen.compile builds for those presets: benchmarks/models.py's (--ep
        left out: its ep 1 and virtual ep per model), training_step.py's, fp8.py's.
    python benchmarks/prebuild.py multigpu [--world 2] [--tokens 2048] [--skip-bench]
        tests/test_multigpu.py's layers (direction tests included), benchmarks/multigpu.py's,
        fsdp_overlap.py's and examples/04_train_fsdp_ep.py's at world size R.

--pack FILE.tar.xz (before the subcommand) also writes the kernels built or found to a
tarball (~50 KB a kernel): built here on a CPU machine and carried in .kcache/ as
kernels*.tar.xz, run_gpu.sh unpacks it, so a device call spends no minutes in nvcc.

Each imports the mokgen of the tree it sits in (its parent folder), not an installed one.
"""
from __future__ import annotations

import argparse
import os
import pickle
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

_PLANS: dict = {}

try:  # the plugin's hook order; pytest is needed by `collect` only
    import pytest
    _trylast = pytest.hookimpl(trylast=True)
except ImportError:
    def _trylast(fn):
        return fn


# ------------------------------------------------ collect: a pytest plugin (-p prebuild)
class Collected(Exception):
    """Raised in place of a build: the test has shown what it would build."""


def pytest_addoption(parser):
    parser.addoption("--collect-out", default="collected_kernels.pkl")


def pytest_configure(config):
    from mokgen.compiler import build, codegen, planner
    emit, check = codegen.emit, planner.check

    def record_plan(plan, *args, **kwargs):
        _PLANS[plan.key()] = plan
        return emit(plan, *args, **kwargs)

    def record_planned(plan):
        """Every plan the planner makes for the kernels' arch, as it makes it: a test that
        touches CUDA before its first compile (a module built, then moved to the GPU) ends on
        this CPU machine before it emits, but its layers are planned by then."""
        check(plan)
        if plan.arch == "sm_90a":
            _PLANS[plan.key()] = plan

    def stop(kernels, *args, **kwargs):
        raise Collected()

    codegen.emit, build.build, planner.check = record_plan, stop, record_planned


@_trylast
def pytest_collection_modifyitems(config, items):
    for item in items:  # after conftest's "no GPU" skips: lift them
        item.own_markers[:] = [m for m in item.own_markers if m.name != "skip"]


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--collect-out")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(list(_PLANS.values()), f)
    print(f"\nprebuild collect: {len(_PLANS)} plans -> {path}")


def collect(out: str, files: list) -> int:
    files = files or [os.path.join(ROOT, "tests")]
    # -n 0: in this process, where the plugin records the plans (not in xdist workers)
    pytest.main(["-q", "-n", "0", "-p", "no:cacheprovider", "-p", "prebuild", "-m", "gpu",
                 "--collect-out", out, *files])
    return 0 if os.path.exists(out) else 1


# ---------------------------------------------------------------------------- the plans
def bench_plans(argv: list) -> list:
    """The plans `python -m mokgen bench argv` runs (its own parser and validation)."""
    import mokgen
    from mokgen.harness import bench
    from mokgen.compiler.tuned import tuned_plan
    return [tuned_plan(mokgen.shapes.get(name), ep, "bf16", n, **ov)
            for name, ep, n, ov in bench._configs(bench.parser().parse_args(argv))]


def layer_plans(names: list, eps: list | None, tokens: list, dtypes: list, **over) -> list:
    """The plans mokgen.compile builds (its tuned plan) for these presets at each ep, token
    count and dtype; eps None: benchmarks/models.py's per preset (1 and its virtual ep)."""
    import mokgen
    from models import eps as model_eps
    from mokgen.compiler.tuned import tuned_plan

    out = []
    for name in names:
        shape = mokgen.shapes.get(name)
        out += [tuned_plan(shape, ep, dt, n, **over) for ep in (eps or model_eps(shape))
                for n in tokens for dt in dtypes]
    return out


def multigpu_test_plans(R: int) -> list:
    """The layers tests/test_multigpu.py compiles at world size R (keep in step with it):
    gpu-small at 513, 700 and 256 tokens, with SMs reserved, and at 700 tokens with a
    wrapping ring."""
    import mokgen

    s = mokgen.shapes.get("gpu-small")
    return [mokgen.plan(s, ep=R, tokens_per_rank=n) for n in (513, 700, 256)] + \
        [mokgen.plan(s, ep=R, tokens_per_rank=700, reserve_sms=16)] + \
        [mokgen.plan(s, ep=R, tokens_per_rank=700, minibatch=128, macrobatch=256)]


def example_plans(R: int) -> list:
    """examples/04_train_fsdp_ep.py's layers (--moe mokgen, default sizes, with and without
    overlap_comm)."""
    import mokgen

    s, tokens = mokgen.MoEShape(16, 512, 256, 2, name="lm"), 8 * 128
    return [mokgen.plan(s, ep=R, tokens_per_rank=tokens, **kw)
            for kw in ({}, {"overlap_comm": True})]


def multigpu_bench_plans(R: int, tokens: str | None) -> list:
    import fsdp_overlap
    import multigpu

    args = multigpu.parse(["--tokens", tokens] if tokens else [])
    return multigpu.plans(args, R) + fsdp_overlap.plans(fsdp_overlap.parse([]), R)


def build(plans: list, jobs: int, pack: str | None = None) -> int:
    from mokgen.config import CONFIG
    from mokgen.pytorch.api import build_plans

    t0 = time.perf_counter()
    bins = build_plans(plans, jobs=jobs)
    built = sum(not b.cached for b in bins)
    print(f"prebuild: {len(plans)} plans, {len(bins)} kernels ({built} built, "
          f"{len(bins) - built} cached) in {time.perf_counter() - t0:.0f} s, "
          f"spills {sum(b.spills for b in bins)}, wgmma serialized in "
          f"{sum(bool(b.serialized) for b in bins)} -> {CONFIG.cache}", flush=True)
    if pack:
        write_pack(bins, pack)
    return 0


def write_pack(bins: list, out: str) -> None:
    """The kernels' cache folders (cubin, meta.json, ptxas.txt; no sources) as an xz tarball,
    about 50 KB a kernel: carried to the GPU machine, run_gpu.sh unpacks it into
    $MOKGEN_CACHE, where the loader checks each cubin against its recorded hash."""
    import tarfile

    with tarfile.open(out, "w:xz") as tar:
        for b in bins:
            for name in ("kernel.cubin", "meta.json", "ptxas.txt"):
                path = b.path.parent / name
                if path.exists():
                    tar.add(path, f"{b.path.parent.name}/{name}")
    print(f"prebuild: {len(bins)} kernels packed -> {out} "
          f"({os.path.getsize(out) / 2**20:.1f} MiB)", flush=True)


# ------------------------------------------------------------------------- command line
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="benchmarks/prebuild.py",
                                 description="compile ahead (nvcc, no GPU) the kernels a GPU "
                                             "call will load, into $MOKGEN_CACHE")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2,
                    help="parallel nvcc processes (default: every core)")
    ap.add_argument("--pack", metavar="FILE.tar.xz", default=None,
                    help="also write the built kernels to this tarball, for a GPU machine "
                         "(run_gpu.sh unpacks .kcache/kernels*.tar.xz into its cache)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="list the plans the GPU tests build (runs them on CPU)")
    c.add_argument("out", help="the plan list to write (a .pkl)")
    c.add_argument("files", nargs="*", help="test files (default: tests/)")
    b = sub.add_parser("build", help="build a collected plan list's kernels")
    b.add_argument("plans", nargs="?", help="a plan list from `collect`")
    b.add_argument("--bench", default="", metavar="ARGS",
                   help="also the layers `python -m mokgen bench ARGS` runs")
    m = sub.add_parser("layers", help="the layers mokgen.compile builds for some presets")
    m.add_argument("presets", help="comma list of presets")
    m.add_argument("--ep", default="",
                   help="comma list of EP degrees (default: models.py's, 1 and the virtual one)")
    m.add_argument("--tokens", default="4096", help="comma list of tokens per rank")
    m.add_argument("--dtypes", default="bf16", help="comma list of bf16, fp8, mxfp8")
    m.add_argument("--gemm-bwd", default=None, metavar="TILE",
                   help="as models.py --gemm-bwd, e.g. 128x256x4")
    g = sub.add_parser("multigpu", help="the multi-GPU tests' and benchmarks' layers")
    g.add_argument("--world", type=int, default=2, help="GPUs (default: 2)")
    g.add_argument("--tokens", default=None, help="multigpu.py's --tokens (default: its own)")
    g.add_argument("--skip-bench", action="store_true", help="the tests' kernels only")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.cmd == "collect":
        return collect(a.out, a.files)
    if a.cmd == "build":
        plans = []
        if a.plans:
            with open(a.plans, "rb") as f:
                plans = pickle.load(f)
        if a.bench:
            plans += bench_plans(shlex.split(a.bench))
        return build(plans, a.jobs, a.pack)
    if a.cmd == "layers":
        over = {}
        if a.gemm_bwd:
            from mokgen.cli import _gemm
            over["gemm_bwd"] = _gemm(a.gemm_bwd)
        ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
        return build(layer_plans(a.presets.split(","), ints(a.ep) or None, ints(a.tokens),
                                 a.dtypes.split(","), **over), a.jobs, a.pack)
    plans = multigpu_test_plans(a.world) + example_plans(a.world)
    if not a.skip_bench:
        plans += multigpu_bench_plans(a.world, a.tokens)
    return build(plans, a.jobs, a.pack)


if __name__ == "__main__":
    sys.exit(main())
