"""The wheel a user installs: `pip wheel .` from the checkout's files, installed (not
editable) into a fresh virtual environment, and the commands run there from a folder outside
the checkout, on the wheel's own templates and headers. CPU (the compile needs nvcc)."""
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import mokgen

ROOT = Path(__file__).parents[1]
# one xdist worker builds the wheel and its venv (module fixtures) for the three tests
pytestmark = pytest.mark.xdist_group("wheel")


def _run(cmd, cwd, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MOKGEN_CACHE")}
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env={**clean, **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the package's files: a build inside the checkout would leave
    build/ and mokgen.egg-info there, and a stale build/lib would slip into the wheel."""
    src = tmp_path_factory.mktemp("src")
    for f in ROOT.iterdir():  # pyproject.toml and the files it names (README.md, ...)
        if f.is_file():
            shutil.copy2(f, src)
    shutil.copytree(ROOT / "mokgen", src / "mokgen",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "-q", "-w", dist], cwd=src)
    (whl,) = dist.glob("*.whl")
    assert whl.name == f"mokgen-{mokgen.__version__}-py3-none-any.whl"
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh environment that sees torch and the other dependencies from this one, with
    the wheel installed into its own site-packages (shadowing any mokgen installed here)."""
    env = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", env],
         cwd=env)
    _run([env / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index",
          "--ignore-installed", wheel], cwd=env)
    return env


@pytest.fixture
def outside(tmp_path) -> Path:
    """A working folder away from the checkout, so the import cannot come from the cwd."""
    return tmp_path


def test_the_wheel_holds_every_file_of_the_package(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "mokgen").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    assert files - names == set()
    assert any(n.startswith("mokgen/compiler/templates/") and n.endswith(".j2") for n in names)
    assert "mokgen/runtime/include/mokgen/moe_fwd.cuh" in names


def test_installed_wheel_runs_plan_from_its_site_packages(venv, outside):
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=outside).stdout.strip())
    assert site.is_relative_to(venv) and site != Path(sysconfig.get_paths()["purelib"])
    where = _run([python, "-c", "import importlib.metadata as m, mokgen, mokgen.compiler.build "
                                "as b, mokgen.compiler.codegen as c; print(mokgen.__file__); "
                                "print(b.INCLUDE_DIR); print(c.TEMPLATES); "
                                "print(m.version('mokgen'))"], cwd=outside).stdout.split()
    assert [Path(p).relative_to(site).as_posix() for p in where[:3]] == [
        "mokgen/__init__.py", "mokgen/runtime/include", "mokgen/compiler/templates"]
    assert where[3] == mokgen.__version__
    plan = _run([python, "-m", "mokgen", "plan", "--shape", "kimi-k2.7", "--ep", "64",
                 "--tokens", "2048"], cwd=outside).stdout
    assert "kimi-k2.7: E=384" in plan and "ep / local experts      64 / 6" in plan
    script = venv / "bin" / "mokgen"  # the console script: the same command line
    assert _run([script, "--version"], cwd=outside).stdout == f"mokgen {mokgen.__version__}\n"
    assert _run([script, "--help"], cwd=outside).stdout.startswith("usage: mokgen ")


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_installed_wheel_compiles_with_its_own_headers(venv, outside):
    """A cold cache, so nvcc really runs; -lineinfo records the headers' paths in the cubin."""
    cache = outside / "cache"
    out = _run([venv / "bin" / "python", "-m", "mokgen", "compile", "--shape", "tiny", "--ep",
                "2", "--tokens", "256"], cwd=outside, MOKGEN_CACHE=str(cache)).stdout
    assert out.count("(built)") == 3, out
    fwd = next(cache.glob("kernel.fwd_*/kernel.cubin")).read_bytes()
    assert b"site-packages/mokgen/runtime/include/mokgen\0" in fwd  # an entry of its line table
    assert str(venv).encode() in fwd and str(ROOT).encode() not in fwd
