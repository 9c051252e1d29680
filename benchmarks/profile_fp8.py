"""Where the fp8 forward's time goes: the same slice with profiling builds (their results are
wrong; timing only): no_promote = the wgmma stream alone (no scale promotion), plain_epi = no
SwiGLU / quantization in the gate/up epilogue; and comm-SM counts.
Usage: python benchmarks/profile_fp8.py SHAPE EP N DTYPE [COMM_SMS,...]"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
VARIANTS = {"no_promote": "MOKGEN_PROFILE_FP8_NO_PROMOTE", "plain_epi": "MOKGEN_PROFILE_FP8_PLAIN_EPILOGUE"}

if len(sys.argv) in (5, 6):  # driver: one child per variant (MOKGEN_OVERRIDE is read at import)
    import mokgen
    from mokgen import codegen

    name, ep, n, dt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    comm = [int(c) for c in sys.argv[5].split(",")] if len(sys.argv) == 6 else []
    runs = [("full", {}, "0")] + [(f"comm{c}", {}, str(c)) for c in comm]
    for variant, macro in VARIANTS.items():
        folder = tempfile.mkdtemp()
        for k in codegen.emit(mokgen.plan(mokgen.shapes.get(name), ep=ep, dtype=dt,
                                          tokens_per_rank=n), units=("fwd",)):
            with open(os.path.join(folder, k.name + ".cu"), "w") as f:
                f.write(f"#define {macro} 1\n" + k.source)
        runs.append((variant, {"MOKGEN_OVERRIDE": folder}, "0"))
    for variant, env, c in runs:
        subprocess.run([sys.executable, __file__, name, str(ep), str(n), dt, variant, c],
                       env=dict(os.environ, **env), check=True)
    sys.exit(0)

import torch  # noqa: E402

import mokgen  # noqa: E402
from mokgen.bench import make_slice, time_ms  # noqa: E402

name, ep, n, dt, variant, comm = sys.argv[1:7]
ep, n, comm = int(ep), int(n), int(comm)
shape = mokgen.shapes.get(name)
g = torch.Generator(device="cuda").manual_seed(0)
xs, zs, w1, w2, sw1, sw2 = make_slice(shape, ep, n, g)
ov = dict(comm_sms_fwd=comm) if comm else {}
layer = mokgen.compile(shape, ep=ep, dtype=dt, tokens_per_rank=n, virtual=True, **ov)
rt = layer.runtime()
layer(x=xs, router_logits=zs, w1=[w1] * ep, w2=[w2] * ep, shared_w1=sw1, shared_w2=sw2)
ms = time_ms(lambda: rt.forward_rank(0, xs, zs, [w1] * ep, [w2] * ep, sw1, sw2), 20)
print(json.dumps(dict(variant=variant, dtype=dt, shape=name, ep=ep, n=n, ms=round(ms, 3),
                      comm_sms=layer.plan.comm_sms_fwd,
                      tflops=round(shape.forward_flops(n) / ms / 1e9))), flush=True)
