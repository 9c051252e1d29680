import contextlib
import os
from pathlib import Path

import pytest
import torch

from mokgen.compiler import hardware

# CPU tests plan for the CPU default GPU (the H200) on every machine, a GPU machine too: their
# golden plans are its. GPU tests plan for the device in hand (pytest_runtest_setup).
hardware.set_default(hardware.CPU_DEFAULT)


def _has_gpu() -> bool:
    return torch.cuda.is_available()


# Where no GPU is visible the suite runs in pytest-xdist workers, one per core (pyproject's
# `-n auto`), beside the nvcc processes of the compile tests: a torch that spreads its small
# CPU ops over every core then waits on threads the other workers hold (an interpreter test
# ran 10x slower so). One thread per process, children included (torchrun's ranks).
if not _has_gpu():
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core on a CPU machine, at most 8 (each holds torch; more
    gain little on ~150 compile tests), or $PYTEST_XDIST_AUTO_NUM_WORKERS; none where a GPU
    is visible, whose tests share the one device and time it."""
    if _has_gpu():
        return 0
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    return max(1, min(len(os.sched_getaffinity(0)), 8))


def pytest_configure(config):
    from budget import Budget

    config.pluginmanager.register(Budget(config), "mokgen-time-budget")


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible); run on the GPU machine")
    for item in items:
        if _on_gpu(item):
            item.add_marker(skip)


def _on_gpu(item) -> bool:
    return "gpu" in item.keywords or "multigpu" in item.keywords


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of the test (module-scoped ones too): GPU tests plan for the device
    in hand, the others for the pinned CPU default."""
    hardware.set_default(None if _on_gpu(item) else hardware.CPU_DEFAULT)


@pytest.fixture
def rng():
    """A fresh generator per test, seeded from the OS so every run sees new inputs; the
    seed is printed so a failure can be replayed."""
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(
        torch.seed() % 2**31)).item())
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def nccl_rank(monkeypatch):
    """A one-rank NCCL process group on GPU 0 (multicast off), destroyed after the test."""
    import socket

    import torch.distributed as dist

    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


# Kernels that still spill, with the bytes (spill stores + loads; the stack frame likewise)
# they may not exceed: (shape name, unit) -> bytes. A known defect, bounded so it cannot grow
# unseen. Empty: the backwards of DeepSeek-V2-Lite and Llama-4-Scout (16 B), whose producer
# kept values derived from its schedule state across next_task's waits in 56 registers, spill
# nothing since each decode launders that state (BwdSchedule::launder).
KNOWN_SPILLS: dict = {}


def assert_spills_within_known(layer, unit: str, fn: str, r: dict) -> None:
    """No spill and no stack frame in `fn` of `unit`, but for KNOWN_SPILLS' bound."""
    key = (layer.plan.shape.name, unit)
    allowed = KNOWN_SPILLS.get(key, 0) if fn.startswith("mokgen_") else 0
    assert r["spill_stores"] + r["spill_loads"] <= allowed and r["stack"] <= allowed, \
        (unit, fn, r, f"allowed {allowed}")


@contextlib.contextmanager
def kernels_not_built():
    """mokgen.compile with its kernels emitted but not built (no nvcc), for tests of what a
    layer does before any kernel runs (its plan, its argument checks) that read no binary:
    the same kernels' builds are what the nvcc tests check."""
    from mokgen.compiler import build, codegen
    from mokgen.pytorch import api

    def emit_only(plans, jobs=None):
        return [build.Binary(k.name, Path(os.devnull), "", {}) for p in plans
                for k in codegen.emit(p)]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "build_plans", emit_only)
        yield
