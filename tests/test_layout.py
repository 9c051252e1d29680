"""The package's layout is its data flow: shape -> compiler (ir, passes, plan, codegen, build)
-> runtime -> the PyTorch layer, with the harness beside it. These tests read every import
statement (lazy ones inside functions too) and hold the arrows one way."""
import ast
import pathlib

import networkx as nx

PKG = pathlib.Path(__file__).parents[1] / "mokgen"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[tuple[str, str]]:
    """(module, name) of every mokgen import, name "" for `import module`; imports under
    `if TYPE_CHECKING:` are annotations, not arrows."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", None) == "TYPE_CHECKING"
                   for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {(a.name, "") for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {(node.module, a.name) for a in node.names}
    return {(m, n) for m, n in out if m == "mokgen" or m.startswith("mokgen.")}


def _graph() -> nx.DiGraph:
    mods = {_module_name(p): p for p in PKG.rglob("*.py")}
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for name, path in mods.items():
        for module, attr in _imports(path):
            m = f"{module}.{attr}" if f"{module}.{attr}" in mods else module
            while m not in mods:  # a name inside a module, not a module
                m = m.rpartition(".")[0]
            if m != name and m != "mokgen":  # the package's own __init__ re-exports
                g.add_edge(name, m)
    return g


def test_no_relative_imports():
    """Absolute imports only, so a module's place in the layout reads from its imports."""
    rel = [str(p) for p in PKG.rglob("*.py")
           if any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(ast.parse(p.read_text())))]
    assert not rel, rel


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(_graph()))
    assert not cycles, cycles


def _reaches(src_prefix: str, dst_prefixes: tuple[str, ...]) -> list:
    g = _graph()
    return sorted((a, b) for a, b in g.edges
                  if a.startswith(src_prefix) and b.startswith(dst_prefixes))


def test_compiler_does_not_import_the_layer_above_it():
    """The compiler lowers onto the runtime's ABI (runtime.abi, runtime.workspace's sizes) and
    knows nothing of the PyTorch layer or the harness."""
    assert _reaches("mokgen.compiler", ("mokgen.pytorch", "mokgen.harness",
                                        "mokgen.integrations")) == []


def test_runtime_imports_nothing_above_it():
    """Cached kernels run without jinja2, nvcc or the passes: the runtime sees plain sizes."""
    assert _reaches("mokgen.runtime", ("mokgen.compiler", "mokgen.pytorch", "mokgen.harness",
                                       "mokgen.integrations")) == []


def test_runtime_needs_no_compiler_even_through_the_reference():
    """Nothing the runtime imports, directly or not, reaches the compiler: an fp8 layer's
    weight quantizers come in its prologue's cubin, not from nvcc at run time."""
    g = _graph()
    reached = {m for r in g if r.startswith("mokgen.runtime") for m in nx.descendants(g, r)}
    assert sorted(m for m in reached if m.startswith("mokgen.compiler")) == []


def test_product_does_not_import_the_harness():
    """Only the command line reaches the harness (its bench, tune and simulate commands)."""
    g = _graph()
    bad = sorted((a, b) for a, b in g.edges if b.startswith("mokgen.harness")
                 and not a.startswith("mokgen.harness") and a != "mokgen.cli")
    assert bad == [], bad
