"""Widths that are not multiples of the tiles against the same shape rounded up to 256 (issue
16's target: >= 90% of the rounded shape's TFLOP/s, counted on the true shape), forward and
backward, one GPU (virtual ranks). The GPU's time alone (bench_one's queue_ahead: the launches
are queued behind a GPU sleep, so the host's launch gaps are out: a call's host work, ~1 ms,
can exceed these small shapes' GPU time, and the rounded shape's forward moved by 17% between
two runs without it), in ROUNDS alternating rounds of the two shapes; ratios of the medians:
python benchmarks/widths.py [EP] [TOKENS] [DTYPE] [ROUNDS]"""
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import mokgen  # noqa: E402
from mokgen.harness.bench import bench_one  # noqa: E402

ep = int(sys.argv[1]) if len(sys.argv) > 1 else 1
n = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
dtype = sys.argv[3] if len(sys.argv) > 3 else "bf16"
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
PAIRS = [  # (true shape, rounded up)
    (mokgen.MoEShape(64, 2048, 1408, 6, shared_intermediate=2816, name="deepseek-v2-lite"),
     mokgen.MoEShape(64, 2048, 1536, 6, shared_intermediate=2816, name="v2-lite-i1536")),
    (mokgen.MoEShape(64, 1152, 640, 4, shared_intermediate=384, name="odd128"),
     mokgen.MoEShape(64, 1280, 768, 4, shared_intermediate=512, name="odd128-rounded")),
    (mokgen.MoEShape(32, 2880, 2880, 4, shared_experts=0, name="gpt-oss-20b"),
     mokgen.MoEShape(32, 3072, 3072, 4, shared_experts=0, name="gpt-oss-rounded")),
]
g = torch.Generator(device="cuda").manual_seed(0)
for true, rounded in PAIRS:
    runs = {true.name: [], rounded.name: []}
    for _ in range(rounds):
        for shape in (true, rounded):
            r = bench_one(shape, ep, n, 20, g, backward=True, naive=False, queue_ahead=True,
                          dtype=dtype)
            runs[shape.name].append((r["mokgen_ms"], r["backward"]["mokgen_ms"]))
            torch.cuda.empty_cache()
    (tf, tb), (rf, rb) = ([statistics.median(v[i] for v in runs[s.name]) for i in (0, 1)]
                          for s in (true, rounded))
    flops = true.forward_flops(n)
    print(json.dumps(dict(
        shape=true.name, ep=ep, tokens=n, dtype=dtype, rounds=rounds, gpu_time_only=True,
        fwd_ms=tf, bwd_ms=tb, rounded_fwd_ms=rf, rounded_bwd_ms=rb, runs=runs,
        fwd_tflops=flops / tf / 1e9, bwd_tflops=2 * flops / tb / 1e9,
        # the true shape's TFLOP/s over the rounded shape's (each counted on its own shape)
        fwd_vs_rounded=(flops / tf) / (rounded.forward_flops(n) / rf),
        bwd_vs_rounded=(flops / tb) / (rounded.forward_flops(n) / rb))), flush=True)
