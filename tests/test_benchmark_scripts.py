"""The maintained benchmarks on CPU: each answers --help without a GPU, a results file keeps
rows per GPU kind, the GPU machine's driver lists its chunks, and the harness's timing at the
power cap counts only settled calls. (No test reads benchmarks/results: the results move with
every GPU run.)"""
import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmark_scripts import load

ROOT = Path(__file__).parents[1]
SCRIPTS = ("moe_layer", "fp8", "models", "model_stack", "peers_sonicmoe", "peers_deepep",
           "multigpu", "fsdp_overlap", "training_step", "prebuild", "result_file",
           "torchtitan_train")


# ids "multigpu.py", not "multigpu": a bare marker name as an id would skip the case
@pytest.mark.parametrize("name", SCRIPTS, ids=[f"{n}.py" for n in SCRIPTS])
def test_every_benchmark_answers_help_without_a_gpu(name, capsys):
    with pytest.raises(SystemExit) as e:
        load(name).main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out


def _run(gpu, commit):
    return dict(gpu=gpu, torch="2.11", cuda="13.0", commit=commit, time="t")


def test_results_keep_rows_per_gpu_kind_and_key(tmp_path):
    rf = load("result_file")
    key = ("shape", "ep")
    rf.write("layer", [dict(shape="a", ep=1, ms=1.0), dict(shape="b", ep=1, ms=2.0)], key,
             out=str(tmp_path), meta=_run("NVIDIA H200", "c1"))
    # another GPU kind: side by side
    rf.write("layer", [dict(shape="a", ep=1, ms=1.5)], key, out=str(tmp_path),
             meta=_run("NVIDIA H100 80GB HBM3", "c2"))
    # a partial rerun on the first GPU: its row replaced, the other kept
    rf.write("layer", [dict(shape="a", ep=1, ms=0.9)], key, out=str(tmp_path),
             meta=_run("NVIDIA H200", "c3"))
    data = json.loads((tmp_path / "layer.json").read_text())
    assert data["benchmark"] == "layer" and data["key"] == list(key)
    assert {(r["gpu"], r["commit"]) for r in data["runs"]} == {
        ("NVIDIA H100 80GB HBM3", "c2"), ("NVIDIA H200", "c3")}
    got = {(r["gpu"], r["shape"]): (r["ms"], r["commit"]) for r in data["rows"]}
    assert got == {("NVIDIA H200", "a"): (0.9, "c3"), ("NVIDIA H200", "b"): (2.0, "c1"),
                   ("NVIDIA H100 80GB HBM3", "a"): (1.5, "c2")}


def test_merge_folds_a_device_calls_file_into_the_results(tmp_path):
    rf = load("result_file")
    into, sent = tmp_path / "results", tmp_path / "out"
    rf.write("stack", [dict(shape="a", ms=1.0)], ("shape",), out=str(into),
             meta=_run("NVIDIA H200", "c1"))
    rf.write("stack", [dict(shape="b", ms=2.0)], ("shape",), out=str(sent),
             meta=_run("NVIDIA H200", "c2"))
    assert rf.main(["merge", str(sent / "stack.json"), "--into", str(into)]) == 0
    rows = json.loads((into / "stack.json").read_text())["rows"]
    assert {(r["shape"], r["commit"]) for r in rows} == {("a", "c1"), ("b", "c2")}
    with pytest.raises(ValueError, match="cannot merge"):
        rf.merge(dict(benchmark="other", runs=[], rows=[]),
                 dict(benchmark="stack", runs=[], rows=[]), ("shape",))


def test_gpu_driver_lists_its_chunks(tmp_path):
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_gpu.sh"), "list"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    for chunk in ("tests-a", "tests", "layer-ep64", "models-a", "sonicmoe-stage", "multigpu",
                  "deepep", "torchtitan"):
        assert f"\n{chunk} " in out
    # `tests` runs the files it is given, and refuses to run none
    none = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_gpu.sh"), "tests"],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "OUT": str(tmp_path)})
    assert none.returncode == 2 and "name the test files" in none.stdout


def test_sustained_ms_refuses_a_window_with_no_call(monkeypatch):
    """mokgen.harness.bench.sustained_ms (the benchmarks' time at the power cap): a call longer than the
    whole run leaves nothing after the settling time: an error, not a rate made up from the
    settling calls."""
    from mokgen.harness import bench
    now = [0.0]

    def call():
        now[0] += 1.0

    monkeypatch.setattr(bench.time, "time", lambda: now[0])
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    with pytest.raises(ValueError):
        bench.sustained_ms(call, seconds=0.5, batch=1)
    now[0] = 0.0
    assert abs(bench.sustained_ms(lambda: now.__setitem__(0, now[0] + 0.01), 1.0) - 10.0) < 1e-6


def test_prebuild_collect_records_layers_a_gpu_test_plans_before_touching_cuda(tmp_path):
    """`prebuild.py collect` on this CPU machine: a GPU test ends at its first compile (its
    plan recorded there) or at its first CUDA call; a layer it planned before that (a module
    built, then moved to the GPU) is recorded too, so the kernels pack holds both."""
    import pickle
    import sys

    (tmp_path / "test_fake_gpu.py").write_text(
        "import pytest, torch, mokgen\n"
        "pytestmark = pytest.mark.gpu\n"
        "def test_planned_then_cuda():\n"
        "    mokgen.MoE(mokgen.shapes.get('gpu-small'), tokens_per_rank=300)\n"
        "    torch.zeros(1, device='cuda')\n"
        "def test_compiled():\n"
        "    mokgen.compile(mokgen.shapes.get('gpu-small'), ep=2, tokens_per_rank=256,\n"
        "                   virtual=True)\n")
    out = tmp_path / "plans.pkl"
    env = dict(os.environ, MOKGEN_GPU="h100-sxm", PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "prebuild.py"), "collect",
                    str(out), str(tmp_path / "test_fake_gpu.py")], env=env, cwd=tmp_path,
                   capture_output=True, text=True, timeout=300)
    plans = pickle.loads(out.read_bytes())
    assert sorted((p.ep, p.tokens_per_rank) for p in plans) == [(1, 300), (2, 256)]


def test_model_stack_plans_fp8_stacks_with_their_quantized_weights():
    """--dtype reaches the plan the stack is sized by: an fp8 Qwen3-30B-A3B layer holds its
    quantized weights (1.2 GB) and keeps less of its activations (no h), so fewer fit the
    same card than in bf16; the bf16 rows keep their results key (no dtype field)."""
    stack = load("model_stack")
    bf16, fp8 = (stack.fitting_layers("qwen3-30b-a3b", 8192, False, dtype=d)
                 for d in ("bf16", "fp8"))
    assert 0 < fp8 < bf16
    assert stack.KEY[-1] == "dtype"
