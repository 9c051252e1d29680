"""benchmarks/NAME.py loaded as a module for the tests that check a benchmark script's
arithmetic or plans (benchmarks/ is not a package)."""
import importlib.util
import pathlib


def load(name: str):
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
