"""The examples a new user runs first, on CPU as CI has it: each runs to its end (no GPU:
01 and 05 plan, 02 also compiles; hf_patch.py says it needs a GPU). 03 runs in the GPU
suite (test_gpu_module), 04 in test_example_fsdp."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(name, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("name,expect", [
    ("01_inspect_plan.py", "--- fwd_"),            # the plan, its graph and its CUDA source
    ("05_model_stack.py", "trains 50 such layers at most"),  # the memory report (H200)
])
def test_planning_examples_run_without_a_gpu(name, expect):
    res = run(name)
    assert res.returncode == 0, res.stderr[-3000:]
    assert expect in res.stdout


@pytest.mark.nvcc
@pytest.mark.skipif(not __import__("shutil").which("nvcc"), reason="nvcc not on PATH")
def test_new_shape_example_compiles_without_a_gpu():
    res = run("02_new_shape.py")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "my-moe" in res.stdout and "'spill_stores': 0" in res.stdout
    assert not re.search(r"'spill_(stores|loads)': [1-9]", res.stdout), "a unit spills"


def test_hf_patch_example_says_it_needs_a_gpu():
    res = run("hf_patch.py")
    assert res.returncode == 1 and "needs a CUDA GPU" in res.stderr
