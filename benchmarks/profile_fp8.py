"""Where the fp8 forward's time goes: the same slice with profiling builds (a plan's `profile`;
their results are wrong; timing only): no_promote = the wgmma stream alone (no scale
promotion), plain_epi = no SwiGLU / quantization in the gate/up epilogue; and comm-SM counts.
Usage: python benchmarks/profile_fp8.py SHAPE EP N DTYPE [COMM_SMS,...]"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import mokgen  # noqa: E402
from mokgen.harness.bench import make_slice, time_ms  # noqa: E402

name, ep, n, dt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
comm = [int(c) for c in sys.argv[5].split(",")] if len(sys.argv) > 5 else []
runs = [("full", {})] + [(f"comm{c}", dict(comm_sms_fwd=c)) for c in comm] + [
    ("no_promote", dict(profile=("fp8_no_promote",))),
    ("plain_epi", dict(profile=("fp8_plain_epilogue",)))]
shape = mokgen.shapes.get(name)
g = torch.Generator(device="cuda").manual_seed(0)
xs, zs, w1, w2, sw1, sw2 = make_slice(shape, ep, n, g)
for variant, ov in runs:
    layer = mokgen.compile(shape, ep=ep, dtype=dt, tokens_per_rank=n, virtual=True, **ov)
    rt = layer.runtime()
    layer(x=xs, router_logits=zs, w1=[w1] * ep, w2=[w2] * ep, shared_w1=sw1, shared_w2=sw2)
    ms = time_ms(lambda: rt.forward_rank(0, xs, zs, [w1] * ep, [w2] * ep, sw1, sw2), 20)
    print(json.dumps(dict(variant=variant, dtype=dt, shape=name, ep=ep, n=n, ms=round(ms, 3),
                          comm_sms=layer.plan.comm_sms_fwd,
                          tflops=round(shape.forward_flops(n) / ms / 1e9))), flush=True)
