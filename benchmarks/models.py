"""How fast are public models' MoE layers against the PyTorch a user would write? Each model's
whole layer at ep = 1 and rank 0's slice of a virtual ep = 8 deployment (the largest ep <= 8
dividing E where 8 does not), forward and training step, against torch._grouped_mm with
autograd for the backward, on the same inputs in one process, one GPU.

    python benchmarks/models.py [--models qwen3-30b-a3b,...] [--tokens 4096] [--ep 1,8]
        [--iters 20] [--sustained S] [--gemm TILE] [--gemm-bwd TILE] [--out DIR]

The training step is the forward without autograd plus the backward after a forward that kept
what it needs (mokgen: its ring; PyTorch: autograd's saved tensors), both sides alike.
--sustained S also runs both training steps back to back for S seconds each: the rate a
training loop holds once the board's power cap has set the clock (short synced loops run
partly before it). Rows (mokgen.harness.bench.bench_one's, with the backward) go into
DIR/models.json, rows per GPU kind (benchmarks/result_file.py), and a table is printed. A
layer that does not fit the GPU (deepseek-v3 with its baseline on an 80 GB H100) is skipped
and named at the end."""
import argparse
import gc
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import mokgen  # noqa: E402
from mokgen.harness.bench import bench_one  # noqa: E402
from mokgen.cli import _gemm  # noqa: E402
from mokgen.harness.plot import plot  # noqa: E402

import result_file  # noqa: E402

MODELS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "qwen1.5-moe-a2.7b", "deepseek-v2-lite",
          "deepseek-v3", "mixtral-8x7b", "mixtral-8x22b", "olmoe-1b-7b", "llama-4-scout",
          "granite-3.0-3b-a800m")


KEY = ("shape", "ep", "tokens", "overrides")


def eps(shape) -> list:
    return [1, max(d for d in range(1, 9) if shape.num_experts % d == 0)]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="benchmarks/models.py",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS),
                    help="comma list of model presets (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--iters", type=int, default=20, help="timed calls a measurement")
    ap.add_argument("--ep", default="", help="comma list of ep (default: 1 and the virtual one)")
    ap.add_argument("--out", default=result_file.RESULTS,
                    help="folder of models.json (default: %(default)s)")
    ap.add_argument("--gemm-bwd", type=_gemm, default=None, metavar="BMxBNxSTAGES[-...]",
                    help="the backward's GEMM tile and schedule (mokgen.compile gemm_bwd)")
    ap.add_argument("--gemm", type=_gemm, default=None, metavar="BMxBNxSTAGES[-...]",
                    help="the forward's (mokgen.compile gemm_fwd), e.g. 128x256x4-pair")
    ap.add_argument("--minibatch", type=int, default=None,
                    help="force the minibatch rows (mokgen.compile minibatch; default: the pass)")
    ap.add_argument("--sustained", type=float, default=0.0, metavar="S",
                    help="also both training steps back to back for S seconds each, at the "
                         "power cap")
    a = ap.parse_args(argv)
    over = dict(gemm_bwd=a.gemm_bwd) if a.gemm_bwd else {}
    if a.gemm:
        over["gemm_fwd"] = a.gemm
    if a.minibatch:
        over["minibatch"] = a.minibatch
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, too_big = [], []
    for name in a.models.split(","):
        for ep in ([int(e) for e in a.ep.split(",")] if a.ep else eps(mokgen.shapes.get(name))):
            try:
                r = bench_one(name, ep, a.tokens, a.iters, g, backward=True, naive=False,
                              sustained=a.sustained, **over)
            except torch.OutOfMemoryError:  # e.g. deepseek-v3's weights and gradients, 80 GB
                too_big.append(f"{name} ep {ep}")
                print(f"{name} ep {ep}: out of memory on this GPU; skipped", flush=True)
                gc.collect()
                torch.cuda.empty_cache()
                continue
            b = r["backward"]
            r["train_mokgen_ms"] = r["mokgen_ms"] + b["mokgen_ms"]
            r["train_grouped_ms"] = r["grouped_ms"] + b["grouped_ms"]
            r["overrides"] = {k: str(v) for k, v in over.items()}
            rows.append(r)
            print(json.dumps(r), flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    result_file.write("models", rows, KEY, out=a.out,
                      plot=lambda j, p: plot(j, p, what="MoE layer forward, bf16, public models"))
    print("| model | ep | N | fwd TFLOP/s | grouped | x | train TFLOP/s | grouped | x |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f3 = 3 * r["flops"] / 1e9
        print(f"| {r['shape']} | {r['ep']} | {r['tokens']} | {r['mokgen_tflops']:.0f} | "
              f"{r['grouped_tflops']:.0f} | {r['grouped_ms'] / r['mokgen_ms']:.2f} | "
              f"{f3 / r['train_mokgen_ms']:.0f} | {f3 / r['train_grouped_ms']:.0f} | "
              f"{r['train_grouped_ms'] / r['train_mokgen_ms']:.2f} |")
    if too_big:
        print(f"not run (out of memory on this GPU): {', '.join(too_big)}")
    if a.sustained > 0:
        print(f"\nback to back for {a.sustained:g} s (power-capped), training step:")
        print("| model | ep | mokgen TFLOP/s | grouped | x |")
        print("|---|---|---|---|---|")
        for r in rows:
            b, f3 = r["backward"], 3 * r["flops"] / 1e9
            m, gr = b["mokgen_train_sustained_ms"], b["grouped_train_sustained_ms"]
            print(f"| {r['shape']} | {r['ep']} | {f3 / m:.0f} | {f3 / gr:.0f} | {gr / m:.2f} |")


if __name__ == "__main__":
    main()
