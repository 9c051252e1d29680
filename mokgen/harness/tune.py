"""Autotuner: time the plan's candidate minibatch sizes and comm-SM counts on the GPU, keep
the winner in the cache; `mokgen.compile` then uses it instead of the cost model's choice.

Each candidate is timed on the same per-rank slice as the benchmark (rank 0 of `ep` virtual
ranks). The cost model's prediction is printed beside each measurement, so the model's
constants (mokgen/compiler/hardware.py) can be corrected from the table. Then, where the shape has a
backward kernel, the backward's comm SMs around the plan's are timed the same way (rank 0's
backward after its forward) at the forward's winner: the backward's minibatches are the
forward's, so the two searches are independent but for that.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys

from mokgen import plan as make_plan
from mokgen import shapes
from mokgen.compiler import limits
from mokgen.compiler.passes.granularity import predict_forward_s
from mokgen.compiler.tuned import tuned_file
from mokgen.harness.progress import progress


def candidates(base) -> list:
    b, c = base.minibatch, base.comm_sms_fwd
    tile = base.block_m
    minis = sorted({max(tile, b // 2 // tile * tile), b, 2 * b})  # half, the model's, double
    # 0 (gathered rows, no comm CTAs: sm_partition.gathers) only where the model chose it
    comms = sorted({x for x in (c - 2, c, c + 2, c + 4) if min(c, 1) <= x < base.num_sms // 2})
    out = []
    for mb in minis:
        for cs in comms:
            try:
                out.append(make_plan(base.shape, ep=base.ep, dtype=base.dtype,
                                     tokens_per_rank=base.tokens_per_rank, minibatch=mb,
                                     comm_sms_fwd=cs))
            except ValueError:
                continue
    return out


def backward_candidates(plan) -> list:
    """`plan` with its backward's comm SMs moved around the model's choice."""
    c = plan.comm_sms_bwd
    out = []
    for cs in sorted({x for x in (c - 2, c, c + 2, c + 4) if min(c, 1) <= x < plan.num_sms // 2}):
        try:
            out.append(make_plan(plan.shape, ep=plan.ep, dtype=plan.dtype,
                                 tokens_per_rank=plan.tokens_per_rank, minibatch=plan.minibatch,
                                 comm_sms_fwd=plan.comm_sms_fwd, comm_sms_bwd=cs))
        except ValueError:
            continue
    return out


def tune(shape, ep: int, dtype: str, tokens: int, iters: int = 20,
         backward: bool = True) -> dict:
    import torch

    from mokgen.harness.bench import make_slice, time_ms

    if not torch.cuda.is_available():
        raise RuntimeError("tuning needs a CUDA GPU; none is visible")
    base = make_plan(shape, ep=ep, dtype=dtype, tokens_per_rank=tokens)
    g = torch.Generator(device="cuda").manual_seed(0)
    xs, zs, w1, w2, sw1, sw2 = make_slice(shape, ep, tokens, g)
    args = (xs, zs, [w1] * ep, [w2] * ep, sw1, sw2)
    rows, cands = [], candidates(base)
    for p in progress(cands, "tune"):
        rows.append(dict(minibatch=p.minibatch, comm_sms_fwd=p.comm_sms_fwd,
                         measured_ms=_time_rank0(p, args, iters, time_ms),
                         predicted_ms=1e3 * predict_forward_s(p),
                         model_choice=(p.minibatch, p.comm_sms_fwd) == (base.minibatch,
                                                                        base.comm_sms_fwd)))
        gc.collect()  # a virtual layer of many ranks holds GBs: free it before the next
        torch.cuda.empty_cache()
    i = min(range(len(rows)), key=lambda j: rows[j]["measured_ms"])
    best, winner, bwd_rows = dict(rows[i]), cands[i], []
    # keep_h plans: the per-rank slice's backward follows its own forward, so it runs the
    # resident twin (plan.resident_twin), while a stacked layer's backward runs the kernel
    # that pulls x; one comm_sms_bwd would force both, so their backward is not tuned
    if backward and limits.backward_unsupported(base) is None and not winner.keep_h:
        dys = [torch.randn(x.shape, device=x.device, generator=g).bfloat16() for x in xs]
        for p in progress(backward_candidates(winner), "tune backward"):
            bwd_rows.append(dict(comm_sms_bwd=p.comm_sms_bwd,
                                 measured_ms=_time_rank0_backward(p, args, dys, iters, time_ms),
                                 model_choice=p.comm_sms_bwd == base.comm_sms_bwd))
            gc.collect()
            torch.cuda.empty_cache()
        best["comm_sms_bwd"] = min(bwd_rows, key=lambda r: r["measured_ms"])["comm_sms_bwd"]
    path = tuned_file(shape, ep, dtype, tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(best=best, rows=rows, backward_rows=bwd_rows,
                                   gpu=torch.cuda.get_device_name()), indent=1))
    tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    # keep_h: whether the winner's backward went untuned for keep_h (above)
    return dict(best=best, rows=rows, backward_rows=bwd_rows, path=str(path),
                keep_h=winner.keep_h)


def _time_rank0(plan, args, iters: int, time_ms) -> float:
    """Median ms of rank 0's forward under `plan` (the layer dies with this frame)."""
    from mokgen.pytorch.api import compile_layer

    layer = compile_layer(plan, virtual=True)
    rt = layer.runtime()
    layer(*args)  # every rank's routes and combine rows exist
    return time_ms(lambda: rt.forward_rank(0, *args), iters)


def _time_rank0_backward(plan, args, dys, iters: int, time_ms) -> float:
    """Median ms of rank 0's backward under `plan`, each after its forward (untimed), which
    leaves macrobatch 0 in the ring as training does."""
    from mokgen.pytorch.api import compile_layer

    xs, zs, w1s, w2s, sw1, sw2 = args
    layer = compile_layer(plan, virtual=True)
    rt, bwd = layer.runtime(), layer.backward_runtime()
    layer(*args)
    return time_ms(lambda: bwd.backward_rank(0, dys, xs, w1s, w2s, sw1, sw2), iters,
                   setup=lambda: rt.forward_rank(0, *args, save=True))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of `python -m mokgen tune` (mokgen.cli's subcommand and main())."""
    ap.add_argument("--shape", required=True,
                    help="shape preset, any case (python -m mokgen plan --help lists them)")
    ap.add_argument("--ep", type=int, default=8,
                    help="expert-parallel degree; rank 0's slice is timed on this GPU "
                         "(default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=2048,
                    help="tokens per rank (default: %(default)s)")
    ap.add_argument("--dtype", default="bf16", help="bf16 | fp8 | mxfp8 (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=20,
                    help="timed runs per candidate; the median is kept (default: %(default)s)")
    ap.add_argument("--no-backward", action="store_true", help="tune the forward only")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mokgen tune", description=(
        "time candidate minibatch sizes and comm-SM counts on the GPU; keep the winner for "
        "mokgen.compile"))
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    try:
        shape = shapes.get(args.shape)
        make_plan(shape, ep=args.ep, dtype=args.dtype, tokens_per_rank=args.tokens)
        if args.iters <= 0:
            raise ValueError(f"iters must be a positive int, got {args.iters}")
        result = tune(shape, args.ep, args.dtype, args.tokens, args.iters,
                      backward=not args.no_backward)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'minibatch':>9} {'comm SMs':>8} {'measured ms':>11} {'model ms':>9}")
    best = result["best"]
    for r in result["rows"]:
        won = (r["minibatch"], r["comm_sms_fwd"]) == (best["minibatch"], best["comm_sms_fwd"])
        mark = " <- best" if won else (" (cost model)" if r["model_choice"] else "")
        print(f"{r['minibatch']:>9} {r['comm_sms_fwd']:>8} {r['measured_ms']:>11.3f} "
              f"{r['predicted_ms']:>9.3f}{mark}")
    if not args.no_backward and not result["backward_rows"] and result["keep_h"]:
        print("backward comm SMs not tuned: a keep_h plan runs two backward kernels (the "
              "resident twin after its own forward, the x-pulling one in a stack)")
    if result["backward_rows"]:
        print(f"backward at that minibatch: {'comm SMs':>8} {'measured ms':>11}")
        for r in result["backward_rows"]:
            mark = (" <- best" if r["comm_sms_bwd"] == result["best"]["comm_sms_bwd"] else
                    " (cost model)" if r["model_choice"] else "")
            print(f"{'':>28}{r['comm_sms_bwd']:>8} {r['measured_ms']:>11.3f}{mark}")
    print(f"stored in {result['path']}")
    return 0
