"""The one results file of each benchmark: benchmarks/results/<name>.json holds the latest
measurement of every row on every kind of GPU, so an H100's rows and an H200's stand side by
side and a table can be rendered from the file alone.

    {"benchmark": "<name>",
     "runs": [{"gpu": ..., "torch": ..., "cuda": ..., "commit": ..., "time": ..., ...}],
     "rows": [{"gpu": ..., "commit": ..., <the benchmark's columns>}, ...]}

`runs` holds the latest run's versions per GPU kind (and per world size where the benchmark
has one); each row names the GPU and commit that measured it. Writing a run replaces the rows
of its GPU whose key (the benchmark's identity columns: shape, ep, tokens, ...) it measured
again and keeps every other row, so a benchmark can be run in parts (one device call each).

Not an entry point of its own but for `merge`, which folds result files a GPU machine sent
back into benchmarks/results/ (a device call writes only its own rows):

    python benchmarks/result_file.py merge OUT/results/*.json [--into benchmarks/results]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def run_meta(**extra) -> dict:
    """The versions a run records: GPU, torch, CUDA, commit ($MOKGEN_COMMIT, else git's HEAD)."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from mokgen.harness.bench import results_commit

    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                cuda=torch.version.cuda, commit=results_commit(),
                time=time.strftime("%Y-%m-%d %H:%M"), **extra)


def _ident(row: dict, key: tuple) -> str:
    return json.dumps([row.get("gpu")] + [row.get(k) for k in key], sort_keys=True, default=str)


def merge(old: dict | None, new: dict, key: tuple) -> dict:
    """`new`'s runs and rows over `old`'s (both in the file's form): a row of `new` replaces
    the row of `old` with the same GPU and key; a run replaces `old`'s run on the same GPU
    (and world size)."""
    if old and old.get("benchmark") != new["benchmark"]:
        raise ValueError(f"cannot merge {new['benchmark']!r} rows into a "
                         f"{old.get('benchmark')!r} file")
    run_id = lambda r: (r.get("gpu"), r.get("world"))  # noqa: E731
    fresh_runs = {run_id(r) for r in new["runs"]}
    fresh_rows = {_ident(r, key) for r in new["rows"]}
    runs = [r for r in (old or {}).get("runs", []) if run_id(r) not in fresh_runs]
    rows = [r for r in (old or {}).get("rows", []) if _ident(r, key) not in fresh_rows]
    return dict(benchmark=new["benchmark"], key=list(key), runs=runs + new["runs"],
                rows=rows + new["rows"])


def write(name: str, rows: list, key: tuple, out: str = RESULTS, meta: dict | None = None,
          plot=None) -> str:
    """Merge this run's `rows` (each gets the run's gpu and commit) into OUT/<name>.json.
    `meta`: the run's versions (run_meta(), with what else the run holds). `plot(json, png)`:
    a figure of this run's rows alone (mokgen.harness.plot's readers: {meta, rows}) as OUT/<name>.png;
    skipped where matplotlib is missing."""
    meta = meta or run_meta()
    tagged = [dict(r, gpu=meta["gpu"], commit=meta["commit"]) for r in rows]
    path = os.path.join(out, f"{name}.json")
    old = None
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    data = merge(old, dict(benchmark=name, runs=[meta], rows=tagged), key)
    os.makedirs(out, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    if plot is not None:
        _plot(plot, meta, tagged, os.path.join(out, f"{name}.png"))
    return path


def _plot(plot, meta: dict, rows: list, png: str) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(dict(meta, meta=meta, rows=rows), f, default=str)
    try:
        plot(f.name, png)
    except ImportError as e:  # matplotlib is optional
        print(f"no plot: {e}", flush=True)
    finally:
        os.unlink(f.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="fold result files (a GPU machine's $OUT/results/*.json) into the "
                    "repository's benchmarks/results/<name>.json, rows per GPU kind")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge result files into the results folder")
    m.add_argument("files", nargs="+", help="result files written by the benchmarks")
    m.add_argument("--into", default=RESULTS, help="the results folder (default: %(default)s)")
    a = ap.parse_args(argv)
    for path in a.files:
        with open(path) as f:
            new = json.load(f)
        target = os.path.join(a.into, f"{new['benchmark']}.json")
        old = None
        if os.path.exists(target) and os.path.abspath(target) != os.path.abspath(path):
            with open(target) as f:
                old = json.load(f)
        data = merge(old, new, tuple(new.get("key", ())))
        with open(target, "w") as f:
            json.dump(data, f, indent=1, default=str)
        png = path[:-5] + ".png"
        if os.path.exists(png) and os.path.abspath(os.path.dirname(png)) != os.path.abspath(a.into):
            with open(png, "rb") as src, open(target[:-5] + ".png", "wb") as dst:
                dst.write(src.read())
        print(f"{path} -> {target}: {len(new['rows'])} rows of {len(data['rows'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
