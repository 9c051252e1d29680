"""How fast is the layer on one rank's slice of an EP deployment? Rank 0's forward and backward
of each preset at ep 8 and 64 (its share of the experts, every rank's tokens routed to them),
against the PyTorch pipelines a user would write (torch._grouped_mm with autograd, and a
per-expert loop) and the dense cuBLAS floor of the same FLOPs, on one GPU.

    python benchmarks/moe_layer.py [--shapes kimi-k2.7,...] [--ep 8,64] [--tokens 1024,2048,4096]
        [--forward-only] [--no-naive] [--iters 50] [--out DIR]

The measurement is `python -m mokgen bench` (mokgen/harness/bench.py: what is timed and how); this
script runs it with the backward on and folds its rows into DIR/moe_layer.json (rows per GPU
kind, benchmarks/result_file.py) and DIR/moe_layer.png (this run's forward TFLOP/s).
"""
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from mokgen.harness import bench  # noqa: E402

import result_file  # noqa: E402

KEY = ("shape", "ep", "tokens", "overrides", "measured")


def parser():
    ap = bench.parser()
    ap.prog = "benchmarks/moe_layer.py"
    ap.description = __doc__.split("\n\n")[0]
    ap.add_argument("--forward-only", action="store_true",
                    help="time the forward alone (default: forward and backward)")
    ap.set_defaults(out=result_file.RESULTS)
    (out,) = [x for x in ap._actions if x.dest == "out"]
    out.help = "folder of moe_layer.json and .png (default: benchmarks/results)"
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parser().parse_args(argv)  # --help and argument errors before any GPU work
    passed = [v for v in argv if v != "--forward-only"]
    if "--out" in passed:  # the measurement writes into a folder of its own
        i = passed.index("--out")
        del passed[i:i + 2]
    passed = [v for v in passed if not v.startswith("--out=")]
    if not a.forward_only and "--backward" not in passed:
        passed.append("--backward")
    with tempfile.TemporaryDirectory() as tmp:
        rc = bench.main(passed + ["--out", tmp])
        if rc:
            return rc
        (name,) = [f for f in os.listdir(tmp) if f.endswith(".json")]
        with open(os.path.join(tmp, name)) as f:
            data = json.load(f)
        measured = "fwd" if a.forward_only else "fwd+bwd"
        rows = [dict(r, measured=measured) for r in data["rows"]]
        path = result_file.write("moe_layer", rows, KEY, out=a.out,
                                 meta=dict(data["meta"], measured=measured))
        png = os.path.join(tmp, name[:-5] + ".png")
        if os.path.exists(png):
            shutil.copyfile(png, os.path.join(a.out, "moe_layer.png"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
