"""Where the backward's time goes: the same slice with profiling builds (their gradients are
wrong; timing only): no_wgrad drops the routed weight-gradient tiles; fp8 plans also
no_wgrad_no_dh_quant (the dgrad epilogue does not quantize dh) and no_wgrad_no_promote (the
fp8 tiles accumulate without scales: the wgmma stream alone).
Usage: python benchmarks/profile_bwd.py SHAPE EP N [DTYPE]
MOKGEN_PROFILE_BUILD_ONLY=1 compiles every variant into $MOKGEN_CACHE and stops (no GPU)."""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

VARIANT = os.environ.get("MOKGEN_PROFILE_VARIANT")
BUILD_ONLY = os.environ.get("MOKGEN_PROFILE_BUILD_ONLY") == "1"
name, ep, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dtype = sys.argv[4] if len(sys.argv) > 4 else "bf16"
VARIANTS = {"full": [], "no_wgrad": ["MOKGEN_PROFILE_NO_ROUTED_WGRAD"]}
if dtype != "bf16":
    VARIANTS["no_wgrad_no_dh_quant"] = VARIANTS["no_wgrad"] + ["MOKGEN_PROFILE_NO_DH_QUANT"]
    VARIANTS["no_wgrad_no_promote"] = VARIANTS["no_wgrad"] + ["MOKGEN_PROFILE_FP8_NO_PROMOTE"]
if VARIANT is None:  # driver: one child process per variant (MOKGEN_OVERRIDE is read at import)
    import mokgen
    from mokgen import codegen

    plan = mokgen.plan(mokgen.shapes.get(name), ep=ep, tokens_per_rank=n, dtype=dtype)
    for variant, defines in VARIANTS.items():
        env = {}
        if defines:
            folder = env["MOKGEN_OVERRIDE"] = tempfile.mkdtemp()
            for k in codegen.emit(plan):
                if k.name.startswith("bwd_"):
                    with open(os.path.join(folder, k.name + ".cu"), "w") as f:
                        f.write("".join(f"#define {d} 1\n" for d in defines) + k.source)
        subprocess.run([sys.executable, __file__, *sys.argv[1:]],
                       env=dict(os.environ, MOKGEN_PROFILE_VARIANT=variant, **env), check=True)
    sys.exit(0)
if BUILD_ONLY:
    import mokgen

    mokgen.compile(mokgen.shapes.get(name), ep=ep, tokens_per_rank=n, dtype=dtype, virtual=True)
    print(f"built {VARIANT}", flush=True)
    sys.exit(0)

import torch  # noqa: E402

from mokgen.bench import bench_one  # noqa: E402

g = torch.Generator(device="cuda").manual_seed(0)
r = bench_one(name, ep, n, 20, g, backward=True, dtype=dtype)
print(json.dumps(dict(variant=VARIANT, shape=name, ep=ep, n=n, dtype=dtype,
                      fwd_ms=round(r["mokgen_ms"], 3),
                      bwd_ms=round(r["backward"]["mokgen_ms"], 3),
                      grouped_bwd_ms=round(r["backward"]["grouped_ms"], 3))), flush=True)
