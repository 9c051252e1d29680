"""Where the backward's time goes: the same slice with a profiling build that drops the routed
weight-gradient tiles (its gradients are then wrong; timing only).
Usage: python benchmarks/profile_bwd.py SHAPE EP N"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

if len(sys.argv) == 4:  # driver: one child process per variant (MOKGEN_OVERRIDE is read at import)
    import mokgen
    from mokgen import codegen

    name, ep, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    folder = tempfile.mkdtemp()
    for k in codegen.emit(mokgen.plan(mokgen.shapes.get(name), ep=ep, tokens_per_rank=n)):
        if k.name.startswith("bwd_"):
            with open(os.path.join(folder, k.name + ".cu"), "w") as f:
                f.write("#define MOKGEN_PROFILE_NO_ROUTED_WGRAD 1\n" + k.source)
    for variant, env in (("full", {}), ("no_wgrad", {"MOKGEN_OVERRIDE": folder})):
        subprocess.run([sys.executable, __file__, *sys.argv[1:4], variant],
                       env=dict(os.environ, **env), check=True)
    sys.exit(0)

import torch  # noqa: E402

from mokgen.bench import bench_one  # noqa: E402

name, ep, n, variant = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
g = torch.Generator(device="cuda").manual_seed(0)
r = bench_one(name, ep, n, 20, g, backward=True)
print(json.dumps(dict(variant=variant, shape=name, ep=ep, n=n, fwd_ms=round(r["mokgen_ms"], 3),
                      bwd_ms=round(r["backward"]["mokgen_ms"], 3),
                      grouped_bwd_ms=round(r["backward"]["grouped_ms"], 3))), flush=True)
