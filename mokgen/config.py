"""Every environment knob, read once, here.

MOKGEN_CACHE     where compiled kernels live (default ~/.cache/mokgen)
MOKGEN_DUMP      a folder: write each kernel's plan, IR text and source there on compile
MOKGEN_OVERRIDE  a folder: a file <kernel>.cu there replaces the generated source (debugging)
MOKGEN_NVCC      the nvcc to use (default: nvcc on PATH)
MOKGEN_WATCHDOG  seconds a device-side spin-wait may last before it reports and traps
MOKGEN_DEBUG     1: build kernels with index checks that record the first failure
MOKGEN_GPU       the GPU plans target when a call names none (gpu=): a kind (h100-sxm, h200,
                 h800, h100-pcie, h20), over the device in hand; unset: the current CUDA
                 device, else the H200 (mokgen/compiler/hardware.py). Set it to prebuild on
                 a CPU the kernels a kind's machine will plan.
MOKGEN_COMMIT    the commit benchmark results record (default: git's HEAD; on the GPU machine
                 the copied tree's .git can lag the files: pass it there)
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Config:
    cache: Path
    dump: Path | None
    override: Path | None
    nvcc: str
    watchdog_s: float
    debug: bool
    commit: str | None
    gpu: str | None = None


def _load() -> Config:
    env = os.environ
    opt = lambda k: Path(env[k]) if env.get(k) else None  # noqa: E731
    return Config(
        cache=Path(env.get("MOKGEN_CACHE") or Path.home() / ".cache" / "mokgen"),
        dump=opt("MOKGEN_DUMP"), override=opt("MOKGEN_OVERRIDE"),
        nvcc=env.get("MOKGEN_NVCC", "nvcc"),
        watchdog_s=float(env.get("MOKGEN_WATCHDOG", "5")),
        debug=env.get("MOKGEN_DEBUG", "0") not in ("", "0"),
        commit=env.get("MOKGEN_COMMIT") or None, gpu=env.get("MOKGEN_GPU") or None)


CONFIG = _load()
