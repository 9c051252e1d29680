"""Where the backward's time goes: the same slice with profiling builds (a plan's `profile`;
their gradients are wrong; timing only): no_wgrad drops the routed weight-gradient tiles;
no_wgrad_epilogue runs them without their epilogue (full - this = that epilogue's cost,
this - no_wgrad = their mainloops and scheduling); no_epilogues runs every backward tile
without its epilogue (the mainloops, the comm CTAs and the dependency waits alone);
no_wgrad_waits starts the weight-gradient tiles without waiting for their rows' dgrad or
their segment order (what those dependencies cost); no_fwd_epilogues runs every forward
tile without its epilogue (read its fwd_ms: the forward's epilogue cost; its backward runs
on garbage); fp8 plans also no_wgrad_no_dh_quant
(the dgrad epilogue does not quantize dh) and no_wgrad_no_promote (the fp8 tiles
accumulate without scales: the wgmma stream alone).
Usage: python benchmarks/profile_bwd.py SHAPE EP N [DTYPE] [--variants full,no_wgrad,...]
                                         [--gemm 128x256x4-sw]"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

from mokgen.harness.bench import bench_one  # noqa: E402
from mokgen.cli import _gemm  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("shape")
ap.add_argument("ep", type=int)
ap.add_argument("n", type=int)
ap.add_argument("dtype", nargs="?", default="bf16")
ap.add_argument("--variants", default="")
ap.add_argument("--gemm", type=_gemm, default=None, metavar="BMxBNxSTAGES[-pp|-sw]",
                help="both kernels' GEMM config (mokgen.cli), e.g. 128x256x4-sw")
args = ap.parse_args()
gemm = dict(gemm_fwd=args.gemm, gemm_bwd=args.gemm) if args.gemm else {}
name, ep, n, dtype = args.shape, args.ep, args.n, args.dtype
VARIANTS = {"full": (), "no_wgrad": ("no_routed_wgrad",),
            "no_wgrad_epilogue": ("no_wgrad_epilogue",), "no_epilogues": ("no_bwd_epilogues",),
            "no_wgrad_waits": ("no_wgrad_waits",), "no_fwd_epilogues": ("no_fwd_epilogues",)}
if dtype != "bf16":
    VARIANTS["no_wgrad_no_dh_quant"] = ("no_routed_wgrad", "no_dh_quant")
    VARIANTS["no_wgrad_no_promote"] = ("no_routed_wgrad", "fp8_no_promote")
if args.variants:  # a subset, e.g. --variants full,no_wgrad_epilogue
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in args.variants.split(",")}
g = torch.Generator(device="cuda").manual_seed(0)
for variant, profile in VARIANTS.items():
    r = bench_one(name, ep, n, 20, g, backward=True, naive=False, dtype=dtype, profile=profile,
                  **gemm)
    print(json.dumps(dict(variant=variant, shape=name, ep=ep, n=n, dtype=dtype,
                          gemm=str(args.gemm or "default"),
                          fwd_ms=round(r["mokgen_ms"], 3),
                          bwd_ms=round(r["backward"]["mokgen_ms"], 3),
                          grouped_bwd_ms=round(r["backward"]["grouped_ms"], 3))), flush=True)
    torch.cuda.empty_cache()
