"""python -m mokgen plan|compile|bench ..."""
from __future__ import annotations

import argparse
import sys

from . import plan as make_plan
from . import shapes


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", required=True, help=f"preset: {', '.join(shapes.names())}")
    p.add_argument("--ep", type=int, default=8, help="expert-parallel degree")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--dtype", default="bf16", help="bf16 | mxfp8")
    for name in ("minibatch", "macrobatch", "comm-sms-fwd", "comm-sms-bwd"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the pass")


def _plan(args):
    overrides = {k: getattr(args, k) for k in
                 ("minibatch", "macrobatch", "comm_sms_fwd", "comm_sms_bwd")
                 if getattr(args, k) is not None}
    return make_plan(shapes.get(args.shape), ep=args.ep, dtype=args.dtype,
                     tokens_per_rank=args.tokens, **overrides)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mokgen")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="run the planning passes and print the plan")
    _common(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--graph", choices=("text", "dot"), default=None,
                   help="also print the task graph")
    args = parser.parse_args(argv)
    try:
        plan = _plan(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "plan":
        print(plan.to_json() if args.json else plan)
        if args.graph:
            from . import ir
            g = ir.build_graph(plan.shape, plan.ep, plan.tokens_per_rank)
            print(ir.to_dot(g) if args.graph == "dot" else ir.to_text(g))
    return 0
