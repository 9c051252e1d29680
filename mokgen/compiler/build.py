"""nvcc driven through ninja, with an on-disk cache that many ranks can share.

A kernel lives in `<cache>/kernel.<name>.<key>/` holding `kernel.cu`, `kernel.cubin`,
`ptxas.txt` (the resource report) and `meta.json` (with the cubin's sha256). The key hashes
everything that changes the binary: the source, the device headers it can include, the flags,
the nvcc version, the arch and the package version. A process builds a kernel while it holds
its lock file (`lock.<name>.<key>`, flock); one that finds it held waits, then loads what the
holder built (or builds it, if the holder failed), so eight ranks on a node compile each
kernel once. Builds happen in a private temp folder that is renamed into place, so nobody
reads a half-written one (and where locks do not hold, ranks that both build keep one); a
cached binary whose hash no longer matches (truncated, corrupted) is thrown away and rebuilt.
Every build() call reads each binary once and checks its hash; the runtime loads those bytes
(`Binary.image`), never the path again, so a file damaged after an earlier build in the same
process is rebuilt too, not loaded.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import warnings
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from mokgen.config import CONFIG
from mokgen.version import __version__

INCLUDE_DIR = Path(__file__).parents[1] / "runtime" / "include"
BASE_FLAGS = ("-O3", "-std=c++17", "-cubin", "-lineinfo", "-Xptxas=-v",
              "--expt-relaxed-constexpr", "-DNDEBUG")


@dataclass(frozen=True)
class Kernel:
    """Generated source of one compilation unit; `name` is also its folder's prefix."""
    name: str
    source: str
    flags: tuple = ()


@dataclass(frozen=True)
class Binary:
    name: str
    path: Path                    # the cubin
    key: str
    resources: dict = field(hash=False)   # function -> {registers, smem, spill_stores, ...}
    build_seconds: float = 0.0
    cached: bool = True
    image: bytes = field(default=b"", hash=False, repr=False, compare=False)  # verified bytes

    @property
    def spills(self) -> int:
        return sum(r["spill_stores"] + r["spill_loads"] for r in self.resources.values())

    @property
    def serialized(self) -> list:
        """Functions whose wgmma instructions ptxas serialized (parse_ptxas)."""
        return [fn for fn, r in self.resources.items() if r.get("wgmma_serialized")]


def gencode(arch: str) -> tuple:
    # the -gencode form: `-arch=sm_90a` alone also runs a plain sm_90 pass that rejects wgmma
    num = arch.removeprefix("sm_")
    return (f"-gencode=arch=compute_{num},code=sm_{num}",)


class BuildError(RuntimeError):
    """nvcc missing or failing: what a build cannot get past (the message says which)."""


@lru_cache(maxsize=None)
def nvcc_version() -> str:
    try:
        out = subprocess.run([CONFIG.nvcc, "--version"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise BuildError(f"nvcc not usable ({CONFIG.nvcc}): {e}. Building a layer needs nvcc "
                         f"from CUDA 12.8+ on PATH, or MOKGEN_NVCC naming it") from e
    return out.strip().splitlines()[-1]


def _headers_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(INCLUDE_DIR.rglob("*.cuh")):
        h.update(p.relative_to(INCLUDE_DIR).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def cache_key(kernel: Kernel, arch: str) -> str:
    h = hashlib.sha256()
    for part in (kernel.source, _headers_digest(), " ".join(BASE_FLAGS + kernel.flags),
                 nvcc_version(), arch, __version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


# an entry function's report, and after it one per device function ptxas kept as a call
# ("Function properties for NAME"): each report's stack and spill line is its own function's
_FUNC = re.compile(r"Compiling entry function '(\w+)'|Function properties for (\w+)")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?")
# ptxas's C751x notes, whatever their reason (C7511: too few registers for the wgmma
# pipeline, seen here; others name calls or accesses to the accumulators): every wgmma of the
# function then waits for the one before, which costs a large backward about 10%
_SERIAL = re.compile(r"wgmma\.mma_async instructions are serialized.*?function '(\w+)'")


def parse_ptxas(text: str) -> dict:
    """Per entry function: registers, static smem, stack frame and spill bytes, and whether
    ptxas serialized its wgmma instructions (wgmma_serialized 0 / 1)."""
    out, fn = {}, None
    fresh = lambda: dict(registers=0, smem=0, stack=0, spill_stores=0, spill_loads=0,  # noqa: E731
                         wgmma_serialized=0)
    for line in text.splitlines():
        if m := _SERIAL.search(line):
            out.setdefault(m.group(1), fresh())["wgmma_serialized"] = 1
        elif m := _FUNC.search(line):
            fn = m.group(1) or m.group(2)
            out.setdefault(fn, fresh())
        elif fn and (m := _SPILL.search(line)):
            out[fn].update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        elif fn and (m := _REGS.search(line)):
            out[fn]["registers"] = int(m[1])
            if s := re.search(r"(\d+) bytes smem", line):
                out[fn]["smem"] = int(s[1])
    return out


def build(kernels: list[Kernel], arch: str = "sm_90a", jobs: int | None = None) -> list[Binary]:
    """Compile every kernel not in the cache, in parallel through ninja; return them all."""
    CONFIG.cache.mkdir(parents=True, exist_ok=True)
    kernels = [_overridden(k) for k in kernels]
    keyed = [(k, cache_key(k, arch)) for k in kernels]
    # a binary is loaded from the bytes read and checked here, never from its path later:
    # one damaged on disk since (this process or another) is rebuilt, not loaded
    found = {(k.name, key): _load(_folder(k, key)) for k, key in keyed}
    missing = [(k, key) for k, key in keyed if found[(k.name, key)] is None]
    built = _build_once(missing, arch, jobs, found) if missing else []
    out = []
    for k, key in keyed:
        loaded = found[(k.name, key)] or _load(_folder(k, key))
        if loaded is None:
            raise RuntimeError(f"mokgen: the cached build of {k.name} in "
                               f"{_folder(k, key)} is unreadable right after building it")
        meta, image = loaded
        report = _folder(k, key) / "ptxas.txt"
        # the report, parsed now: a cached meta.json holds the parse of its build's day (one
        # before a device function's report stopped overwriting its kernel's spills)
        res = parse_ptxas(report.read_text()) if report.exists() else meta["resources"]
        out.append(Binary(k.name, _folder(k, key) / "kernel.cubin", key, res,
                          meta["build_seconds"], cached=(k, key) not in built, image=image))
        if out[-1].serialized:  # correct but slow: say so where the user compiles
            warnings.warn(f"mokgen: ptxas serialized the wgmma instructions of "
                          f"{', '.join(out[-1].serialized)} in {k.name} (C751x, "
                          f"{report}): the kernel is correct but its GEMMs run slower",
                          RuntimeWarning, stacklevel=2)
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load(folder: Path) -> tuple[dict, bytes] | None:
    """(meta.json, the cubin's bytes) if the cubin matches its recorded hash; otherwise remove
    the folder (a truncated or corrupted binary must be rebuilt, never loaded) and None."""
    if not folder.exists():
        return None
    try:
        meta = json.loads((folder / "meta.json").read_text())
        image = (folder / "kernel.cubin").read_bytes()
        if hashlib.sha256(image).hexdigest() == meta["cubin_sha256"]:
            return meta, image
    except (OSError, ValueError, KeyError):
        pass
    shutil.rmtree(folder, ignore_errors=True)
    return None


def _load_meta(folder: Path) -> dict | None:
    loaded = _load(folder)
    return None if loaded is None else loaded[0]


def _folder(k: Kernel, key: str) -> Path:
    return CONFIG.cache / f"kernel.{k.name}.{key}"


def _overridden(k: Kernel) -> Kernel:
    if CONFIG.override and (CONFIG.override / f"{k.name}.cu").exists():
        return Kernel(k.name, (CONFIG.override / f"{k.name}.cu").read_text(), k.flags)
    return k


def _lock(stack: contextlib.ExitStack, k: Kernel, key: str, wait: bool) -> bool:
    """Hold kernel (k, key)'s build lock until `stack` closes; False if another process holds
    it and not `wait`. The OS drops a dead holder's lock. A file system without locks (some
    network mounts: ENOLCK) counts as taken: every rank builds, and the rename keeps one."""
    f = stack.enter_context(open(CONFIG.cache / f"lock.{k.name}.{key}", "a"))
    try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError:
        pass
    return True


def _build_once(missing, arch: str, jobs: int | None, found: dict) -> list:
    """Build the kernels no other process is building, then wait for the others' builders
    and build only what they left unbuilt, putting what they built into `found`; -> the
    (kernel, key) pairs built here. Waits take the locks in key order and a holder never
    waits while it holds one, so no two processes wait on each other."""
    with contextlib.ExitStack() as held:
        mine = [(k, key) for k, key in missing if _lock(held, k, key, wait=False)]
        if mine:
            _compile(mine, arch, jobs)
    theirs = sorted((m for m in missing if m not in mine), key=lambda m: (m[1], m[0].name))
    left = []
    if theirs:
        with contextlib.ExitStack() as held:
            for k, key in theirs:
                _lock(held, k, key, wait=True)
                found[(k.name, key)] = _load(_folder(k, key))
            left = [(k, key) for k, key in theirs if found[(k.name, key)] is None]
            if left:
                _compile(left, arch, jobs)
    return mine + left


def _compile(missing, arch: str, jobs: int | None) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="build.", dir=CONFIG.cache))
    try:
        lines = ["rule nvcc",
                 f"  command = {CONFIG.nvcc} $flags -I{INCLUDE_DIR} -o $out $in > $out.log 2>&1"
                 f" || (cat $out.log; exit 1)",
                 "  description = nvcc $out"]
        for k, key in missing:
            d = tmp / f"kernel.{k.name}.{key}"
            d.mkdir()
            (d / "kernel.cu").write_text(k.source)
            flags = " ".join(BASE_FLAGS + gencode(arch) + k.flags)
            lines += [f"build {d}/kernel.cubin: nvcc {d}/kernel.cu", f"  flags = {flags}"]
        (tmp / "build.ninja").write_text("\n".join(lines) + "\n")
        t0 = time.perf_counter()
        res = subprocess.run(["ninja", "-C", str(tmp), f"-j{jobs or os.cpu_count() or 2}"],
                             capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if res.returncode:
            raise BuildError(f"nvcc failed:\n{res.stdout[-6000:]}{res.stderr[-2000:]}")
        for k, key in missing:
            d = tmp / f"kernel.{k.name}.{key}"
            report = (d / "kernel.cubin.log").read_text()
            (d / "ptxas.txt").write_text(report)
            meta = {"name": k.name, "key": key, "arch": arch, "nvcc": nvcc_version(),
                    "resources": parse_ptxas(report), "build_seconds": seconds,
                    "cubin_sha256": _sha256(d / "kernel.cubin")}
            (d / "meta.json").write_text(json.dumps(meta, indent=2))
            try:  # atomic publish; a rank that lost the race keeps the winner's copy
                os.rename(d, _folder(k, key))
            except OSError:
                if _load_meta(_folder(k, key)) is None:
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
