"""python -m mokgen plan|compile|bench|tune|simulate ..."""
from __future__ import annotations

import argparse
import json
import sys

from mokgen import plan as make_plan
from mokgen import shapes


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", required=True, help=f"preset: {', '.join(shapes.names())}")
    p.add_argument("--ep", type=int, default=8, help="expert-parallel degree")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--dtype", default="bf16", help="bf16 | fp8 | mxfp8")
    for name in ("minibatch", "macrobatch", "comm-sms-fwd", "comm-sms-bwd", "reserve-sms"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the pass")
    p.add_argument("--overlap-comm", action="store_true",
                   help="collectives run beside the layer: leave them SMs")
    p.add_argument("--keep-h", action=argparse.BooleanOptionalAction, default=None,
                   help="each call keeps its own h: no backward replays (one rank, bf16; the "
                        "default where its rules hold); --no-keep-h: h in the shared ring")
    for d in ("fwd", "bwd"):
        p.add_argument(f"--gemm-{d}", type=_gemm, default=None,
                       metavar="BMxBNxSTAGES[-pair]",
                       help=f"override the tile of the {d} GEMM ops, e.g. 128x256x3; -pair "
                            f"(fwd): multicast pairs, e.g. 128x256x4-pair")


def _gemm(text: str) -> tuple:
    """BMxBNxSTAGES[-pair]: a GemmConfig's fields (multicast pairs)."""
    flags = {"": (), "pair": (True,)}
    tile, _, flag = text.partition("-")
    try:
        if flag not in flags:
            raise ValueError(flag)
        return tuple(int(v) for v in tile.split("x")) + flags[flag]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BMxBNxSTAGES[-pair], got {text!r}") from None


def _plan(args):
    overrides = {k: getattr(args, k) for k in
                 ("minibatch", "macrobatch", "comm_sms_fwd", "comm_sms_bwd", "reserve_sms",
                  "gemm_fwd", "gemm_bwd") if getattr(args, k) is not None}
    if args.overlap_comm:
        overrides["overlap_comm"] = True
    if args.keep_h is not None:
        overrides["keep_h"] = args.keep_h
    return make_plan(shapes.get(args.shape), ep=args.ep, dtype=args.dtype,
                     tokens_per_rank=args.tokens, **overrides)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("bench", "tune", "simulate"):  # their own argument parsers
        from importlib import import_module

        return import_module(f"mokgen.harness.{argv[0]}").main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m mokgen", epilog="also: bench ..., tune ..., simulate ... (see their --help)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="run the planning passes and print the plan")
    _common(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--graph", choices=("text", "dot"), default=None,
                   help="also print the task graph, annotated by the passes")
    c = sub.add_parser("compile", help="plan, emit CUDA, build with nvcc (no GPU needed); "
                                        "with --run, also run it on the visible GPU")
    _common(c)
    c.add_argument("--run", action="store_true", help="run and check one call on the GPU")
    args = parser.parse_args(argv)
    try:
        plan = _plan(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "compile":
        return _compile(plan, args.run)
    if args.cmd == "plan":
        from mokgen.pytorch.api import format_memory, memory_report

        if args.json:
            print(json.dumps({**plan.to_dict(), "memory": memory_report(plan)}, indent=2,
                             sort_keys=True))
        else:
            print(plan)
            print(format_memory(memory_report(plan)))
        if args.graph:
            from mokgen.compiler import ir
            print(ir.to_dot(plan.graph) if args.graph == "dot" else ir.to_text(plan.graph))
    return 0


def _compile(plan, run: bool) -> int:
    from mokgen.pytorch.api import compile_layer

    print(plan)
    try:
        layer = compile_layer(plan, virtual=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, b in layer.binaries.items():
        for fn, r in b.resources.items():
            print(f"{name:>9} {fn:<22} regs={r['registers']:<4} smem={r['smem']:<6} "
                  f"stack={r['stack']} spill_st={r['spill_stores']} spill_ld={r['spill_loads']}"
                  + (" WGMMA SERIALIZED (ptxas C751x)" if r.get("wgmma_serialized") else ""))
        print(f"{name:>9} cubin {b.path} ({'cached' if b.cached else 'built'})")
    print(f"build time {layer.build_seconds:.2f} s")
    if run:
        from mokgen.harness.smoke import run_once

        print(run_once(layer))
    return 0
