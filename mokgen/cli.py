"""python -m mokgen plan|compile|bench|tune|simulate ... (also the `mokgen` console script)"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from importlib import import_module

from mokgen.version import __version__
from mokgen import plan as make_plan
from mokgen import shapes
from mokgen.compiler.limits import directions

# The harness's commands, each a module of mokgen.harness with add_arguments(parser) and
# run(args). Their modules import torch, so one is imported only when its command is named:
# the top-level help needs only these lines.
TOOLS = {
    "bench": "time per-rank slices of EP deployments against PyTorch baselines (GPU)",
    "tune": "time the plan's candidate minibatches and comm SMs on the GPU; mokgen.compile "
            "and mokgen.MoE then use the winner",
    "simulate": "predict one rank's forward/backward time in an EP deployment (no GPU)",
}

_OVERRIDES = {
    "minibatch": "rows per pipeline step, a multiple of the GEMM tile's rows",
    "macrobatch": "rows the ring of received rows holds: two or more minibatches",
    "comm-sms-fwd": "SMs that move rows (dispatch, combine) in the forward",
    "comm-sms-bwd": "SMs that move rows in the backward",
    "reserve-sms": "SMs no kernel CTA runs on, left to collectives beside the layer",
    "ring-budget-bytes": "the most bytes the ring may take; below the planner's choice the "
                         "backward replays what does not fit",
    "x-slots": "the backward's x ring as a window of N minibatch slots (a forward that "
               "gathers x, one rank, bf16)",
}
# the exchanges a plan may move otherwise: its memory options (docs/training.md)
_EXCHANGES = {
    "dispatch": "how x rows reach the experts: gather reads them where they are (one rank, "
                "bf16; no comm CTAs, no x ring)",
    "reverse-combine": "how dy reaches the experts in the backward: gather as dispatch's "
                       "(needs --dispatch gather)",
    "reverse-dispatch": "how dx returns: ring writes it over its dy rows (one rank, bf16)",
}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", required=True,
                   help=f"shape preset, any case: {', '.join(shapes.names())}")
    p.add_argument("--ep", type=int, default=8,
                   help="expert-parallel degree: ranks the experts are spread over "
                        "(default: %(default)s)")
    p.add_argument("--tokens", type=int, default=2048,
                   help="tokens per rank per call (default: %(default)s)")
    p.add_argument("--dtype", default="bf16",
                   help="what the routed GEMMs read: bf16 | fp8 | mxfp8 (default: %(default)s)")
    p.add_argument("--gpu", default=None,
                   help="plan for this GPU: h100-sxm, h200, h800, h100-pcie, h20 (default: "
                        "$MOKGEN_GPU, else the visible GPU, else h200)")
    for name, what in _OVERRIDES.items():
        p.add_argument(f"--{name}", type=int, default=None, metavar="N",
                       help=f"{what} (default: the planner's choice)")
    for name, what in _EXCHANGES.items():
        p.add_argument(f"--{name}", choices=directions(name.replace("-", "_")), default=None,
                       help=f"{what} (default: the planner's choice)")
    p.add_argument("--overlap-comm", action="store_true",
                   help="collectives run beside the layer: leave them SMs")
    p.add_argument("--keep-h", action=argparse.BooleanOptionalAction, default=None,
                   help="each call keeps its own h: no backward replays (one rank, bf16; the "
                        "default where its rules hold); --no-keep-h: h in the shared ring")
    for d in ("fwd", "bwd"):
        p.add_argument(f"--gemm-{d}", type=_gemm, default=None,
                       metavar="BMxBNxSTAGES[-pair]",
                       help=f"override the tile of the {d} GEMM ops (128x256x4, the only "
                            f"one); -pair (fwd): multicast pairs, 128x256x4-pair")


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
                  "ring_budget_bytes", "x_slots", "dispatch", "reverse_combine",
                  "reverse_dispatch", "gemm_fwd", "gemm_bwd", "gpu")
                 if getattr(args, k) is not None}
    if args.overlap_comm:
        overrides["overlap_comm"] = True
    if args.keep_h is not None:
        overrides["keep_h"] = args.keep_h
    return make_plan(shapes.get(args.shape), ep=args.ep, dtype=args.dtype,
                     tokens_per_rank=args.tokens, **overrides)


def build_parser(tools=tuple(TOOLS)) -> argparse.ArgumentParser:
    """The command line; the options of the harness commands in `tools` only (their
    modules import torch), the others listed by name and line."""
    prog = "mokgen" if os.path.basename(sys.argv[0]) == "mokgen" else "python -m mokgen"
    parser = argparse.ArgumentParser(
        prog=prog, description="mokgen: a compiler of fused, persistent MoE megakernels. "
        f"Each command has its own help: {prog} COMMAND --help.")
    parser.add_argument("--version", action="version", version=f"mokgen {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")
    plan_help = "run the planning passes and print the plan and its memory (no GPU)"
    p = sub.add_parser("plan", help=plan_help, description=plan_help)
    _common(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--graph", choices=("text", "dot"), default=None,
                   help="also print the task graph, annotated by the passes")
    compile_help = ("plan, emit CUDA, build with nvcc (no GPU needed); with --run, also run "
                    "it on the visible GPU")
    c = sub.add_parser("compile", help=compile_help, description=compile_help)
    _common(c)
    c.add_argument("--run", action="store_true",
                   help="run one call on the GPU (256 tokens a rank), check it against the "
                        "PyTorch reference; exit 1 past the tests' tolerance, or where the "
                        "ep virtual ranks would not fit the GPU's free memory")
    for name, line in TOOLS.items():
        t = sub.add_parser(name, help=line, description=line)
        if name in tools:
            import_module(f"mokgen.harness.{name}").add_arguments(t)
    return parser


def main(argv=None) -> int:
    """The entry point of `python -m mokgen` and of the `mokgen` script."""
    try:
        try:
            return _main(sys.argv[1:] if argv is None else list(argv))
        finally:  # a closed pipe shows at the flush: here, where it can still be caught
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`... | head`): stop quietly. Python flushes stdout again at
        # exit, so point it at devnull first; exit as a process killed by SIGPIPE would.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _main(argv: list) -> int:
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(tools=(command,) if command in TOOLS else ()).parse_args(argv)
    if args.cmd in TOOLS:
        return import_module(f"mokgen.harness.{args.cmd}").run(args)
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
    from mokgen.compiler.build import BuildError
    from mokgen.pytorch.api import compile_layer

    print(plan)
    try:
        layer = compile_layer(plan, virtual=True)
    except (ValueError, BuildError) as e:
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

        text, ok = run_once(layer)
        print(text)
        return 0 if ok else 1
    return 0
