"""Backward comm-SM sweep on one slice:
python benchmarks/bwd_sweep.py SHAPE EP N c1,c2,... [DTYPE]"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mokgen.harness.bench import bench_one  # noqa: E402

name, ep, n, sweep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dtype = sys.argv[5] if len(sys.argv) > 5 else "bf16"
g = torch.Generator(device="cuda").manual_seed(0)
for c in [int(v) for v in sweep.split(",")]:
    r = bench_one(name, ep, n, 20, g, backward=True, comm_sms_bwd=c, dtype=dtype)
    b = r["backward"]
    print(json.dumps(dict(shape=name, ep=ep, n=n, dtype=dtype, comm_sms_bwd=c, fwd_ms=r["mokgen_ms"],
                          bwd_ms=b["mokgen_ms"], bwd_tflops=b["mokgen_tflops"],
                          grouped_tflops=b["grouped_tflops"])), flush=True)
    torch.cuda.empty_cache()
