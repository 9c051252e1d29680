"""The documentation cannot drift from the code: the Python snippets of README.md and docs/*.md
run, every repository path, link and `mokgen.` name they mention exists, the presets table
matches mokgen.shapes, the README's commands parse, and the tables rendered from
benchmarks/results and the planner (docs/render_performance.py) are current.

A snippet's fence says what it needs: ```python runs here (CPU, in the file's order, one
namespace per file); ```python gpu needs a CUDA GPU and nvcc (run by the gpu-marked test);
```python torchrun needs several processes (never run); ```python torchtitan needs the
optional torchtitan extra (run where it imports). Every snippet must at least compile."""
import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 15_000
KINDS = {"", "gpu", "torchrun", "torchtitan"}  # what may follow ```python
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)
ANY_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
TOP = ("mokgen", "docs", "tests", "examples", "benchmarks")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*[\w/]|README\.md|CHANGELOG\.md|LICENSE|"
                  r"pyproject\.toml)" % "|".join(TOP))
NAME = re.compile(r"(?<![\w./])mokgen(?:\.[A-Za-z_]\w*)+")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


def snippets(path: Path) -> list:
    """(line, kind, code) of each ```python block."""
    text = path.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1).strip(), m.group(2))
            for m in FENCE.finditer(text)]


def run(path: Path, kinds: set) -> None:
    """The file's snippets of `kinds` in order, in one namespace. One CPU thread: the snippets'
    tensors are tiny, and on a shared machine a second thread's spin-waits cost seconds."""
    torch.manual_seed(0)
    env = {"__name__": f"docs:{path.name}"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for line, kind, code in snippets(path):
            if kind in kinds:
                try:
                    exec(compile(code, f"{path.name}:{line}", "exec"), env)
                except Exception as e:
                    raise AssertionError(f"{path.relative_to(ROOT)}, the snippet at line "
                                         f"{line}: {type(e).__name__}: {e}") from e
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("path", DOCS, ids=ids(DOCS))
def test_snippets_compile_and_say_what_they_need(path):
    for line, kind, code in snippets(path):
        assert kind in KINDS, f"{path.name}:{line}: ```python {kind}: use one of {KINDS}"
        compile(code, f"{path.name}:{line}", "exec")


@pytest.mark.parametrize("path", DOCS, ids=ids(DOCS))
def test_cpu_snippets_run(path):
    run(path, {""})


@pytest.mark.gpu
@pytest.mark.parametrize("path", DOCS, ids=ids(DOCS))
def test_gpu_snippets_run(path):
    run(path, {"", "gpu"})


@pytest.mark.parametrize("path", DOCS, ids=ids(DOCS))
def test_torchtitan_snippets_run(path):
    if not any(kind == "torchtitan" for _, kind, _ in snippets(path)):
        pytest.skip("no ```python torchtitan snippet")
    pytest.importorskip("torchtitan", reason="torchtitan is an optional extra "
                        "(pip install -e '.[torchtitan]'); it is not installed here")
    run(path, {"", "torchtitan"})


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(path: Path) -> set:
    text = ANY_FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


@pytest.mark.parametrize("path", DOCS, ids=ids(DOCS))
def test_named_paths_links_and_anchors_exist(path):
    text = path.read_text()
    bad = []
    for m in PATH.finditer(text):
        p = m.group(1).rstrip(".")
        if not (ROOT / p).exists():
            bad.append(f"path {p}")
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"link {target}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"anchor {target}")
    assert not bad, f"{path.relative_to(ROOT)} names what does not exist: {bad}"


def resolves(name: str) -> bool:
    """Whether `mokgen.a.b.c` is a module or an attribute of one. A module that needs an
    optional extra not installed here (mokgen.integrations.torchtitan) is read, not
    imported: the name must be defined at its top level."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:  # a submodule not imported yet
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] != "mokgen":  # an optional extra's package
                return defined_in_source(parts[:i], parts[i:])
            return False
        except ImportError:
            return False
    return True


def defined_in_source(module: list, rest: list) -> bool:
    """Whether module (a list of names, a .py file under ROOT) defines rest[0] at its top
    level (the module itself where rest is empty)."""
    import ast

    path = ROOT.joinpath(*module).with_suffix(".py")
    if not path.exists():
        return False
    if not rest:
        return True
    tree = ast.parse(path.read_text())
    top = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    top |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Name)}
    return rest[0] in top


@pytest.mark.parametrize("path", DOCS, ids=ids(DOCS))
def test_named_mokgen_objects_exist(path):
    names = sorted(set(NAME.findall(path.read_text())))
    missing = [n for n in names if not resolves(n)]
    assert not missing, f"{path.relative_to(ROOT)} names what mokgen does not have: {missing}"


def load_renderer():
    spec = importlib.util.spec_from_file_location("render_performance",
                                                  ROOT / "docs" / "render_performance.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    return render


def test_rendered_tables_are_current():
    render = load_renderer()
    stale = [str(p.relative_to(ROOT)) for p, text in render.rendered().items()
             if not p.exists() or p.read_text() != text]
    assert not stale, f"out of date: {stale}; run python docs/render_performance.py"


def test_sonicmoe_section_shows_fp8_rows_where_measured():
    """peers_sonicmoe.py --dtypes bf16,fp8 rows get their own table (issue 63's keys);
    bf16-only rows none."""
    render = load_renderer()
    row = dict(shape="qwen3-30b-a3b", T=8192, D=2048, I=768, E=128, k=8, gpu="H100",
               commit="abc1234", mokgen_fwd_tflops=300.0, sonicmoe_fwd_tflops=290.0,
               mokgen_train_tflops=310.0, sonicmoe_train_tflops=300.0)
    assert "blockwise fp8" not in render.sonicmoe({"rows": [row]})
    fp8 = dict(row, mokgen_fp8_fwd_tflops=450.0, mokgen_fp8_train_tflops=420.0,
               mokgen_fp8_fused_peak_mb=900.0)
    text = render.sonicmoe({"rows": [fp8]})
    assert "blockwise fp8" in text and "| 450 | 420 |" in text and "1.40x" in text


def test_readme_is_short():
    n = len(README.read_text())
    assert n <= README_LIMIT, f"README.md has {n} characters, at most {README_LIMIT}"


def test_presets_table_matches_the_presets():
    import mokgen

    rows = re.findall(r"^\| `([\w.-]+)` \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|",
                      (ROOT / "docs" / "api.md").read_text(), re.M)
    listed = {name: tuple(map(int, dims)) for name, *dims in rows}
    for name, dims in listed.items():
        s = mokgen.shapes.get(name)
        assert dims == (s.num_experts, s.hidden, s.intermediate, s.topk, s.shared_dim), name
    want = set(mokgen.shapes.PRESETS_MAIN) | set(mokgen.shapes.PRESETS_MODELS)
    assert want <= set(listed), f"presets missing from docs/api.md: {sorted(want - set(listed))}"


def test_readme_commands_are_the_set_up_commands_and_parse(capsys):
    """The two commands stay as written; the main one's shape, ep and tokens plan (its build
    and run are the CLI's own tests), and its check's ep virtual ranks fit an 80 GB H100
    (every expert's weights and ep workspaces on one GPU: at ep 64 Kimi-K2.7 needs ~85 GiB)."""
    import mokgen
    from mokgen.cli import main
    from mokgen.compiler import hardware
    from mokgen.harness.smoke import footprint

    text = README.read_text()
    main_cmd = "pip install -e '.[test]' && python -m mokgen compile --shape kimi-k2.7 " \
               "--ep 8 --tokens 2048 --run"
    assert main_cmd in text and "pip install -e '.[test]' && python -m pytest -q" in text
    args = main_cmd.split("python -m mokgen ")[1].split()
    assert main(["plan"] + [a for a in args[1:] if a != "--run"]) == 0
    assert "kimi-k2.7" in capsys.readouterr().out
    plan = mokgen.plan(mokgen.shapes.get("kimi-k2.7"), ep=8, tokens_per_rank=2048,
                       gpu="h100-sxm")
    assert footprint(plan, 256) < 0.9 * hardware.H100_SXM.memory


def test_nothing_points_outside_the_repository():
    outside = re.compile(r"\.\./" + "shared")
    files = [p for d in ("mokgen", "tests", "examples", "docs") for p in (ROOT / d).rglob("*")
             if p.is_file() and p.suffix in (".py", ".md", ".cuh", ".j2", ".cu", ".sh")]
    files += [README, ROOT / "CHANGELOG.md", ROOT / "pyproject.toml"]
    bad = [str(p.relative_to(ROOT)) for p in files if outside.search(p.read_text())]
    assert not bad, f"these point outside the repository: {bad}"


def test_license_is_named_in_the_package_metadata():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in text and "LICENSE" in text
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert os.path.getsize(ROOT / "LICENSE") > 10_000  # the full text


def test_torchtitan_section_compares_same_seed_and_band():
    """A mokgen run is set against torchtitan's run of its seed, the band of torchtitan's
    seeds and their own excursions (what the section's numbers mean)."""
    render = load_renderer()

    def run(impl, seed, level, tps, commit="c1", steps=30):
        return {"gpu": "NVIDIA H100 80GB HBM3", "commit": commit, "model": "debug",
                "impl": impl, "seed": seed, "layers": 8, "batch": 4, "seq": 2048,
                "ac": "selective", "steps": steps, "steps_done": steps, "loss": [level] * steps,
                "tokens_per_s": tps, "peak_mb": 100.0, "data": "t.txt"}
    rows = [run("torchtitan", 0, 1.0, 1000.0), run("torchtitan", 1, 2.0, 1000.0),
            run("torchtitan", 2, 3.0, 1000.0), run("mokgen", 0, 2.5, 1500.0),
            # a later call's short runs: set against each other only, graphs against graphs
            run("torchtitan", 0, 9.0, 800.0, "c2", 24),
            run("torchtitan+graphs", 0, 9.0, 400.0, "c2", 24),
            run("mokgen+graphs", 0, 9.0, 1200.0, "c2", 24)]
    text = render.torchtitan_runs({"rows": rows})
    line = next(ln for ln in text.splitlines() if "| mokgen |" in ln)
    assert "| 1.50x |" in line and "| 100% |" in line and "| 0.0000 |" in line
    graphs = next(ln for ln in text.splitlines() if "| mokgen+graphs |" in ln)
    assert "| 3.00x |" in graphs and graphs.endswith("| - | - |")  # no band of one seed
    assert "Data: t.txt." in text and "at worst 0.0000-1.0000 outside" in text
    assert "GPU time a step by part" not in text  # no run was profiled
    rows[-1]["gpu_ms_per_step"] = {"optimizer": 55.7, "fsdp_copies": 51.3, "mokgen": 30.2,
                                   "rest": 38.3}
    parts = render.torchtitan_runs({"rows": rows}).split("GPU time a step by part")[1]
    assert "| mokgen+graphs | 0 | 55.7 | 51.3 | 30.2 | 38.3 |" in parts
