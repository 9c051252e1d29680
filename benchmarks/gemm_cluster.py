"""Does sharing B between the two CTAs of a cluster pay? (an engine experiment for #16 / #17)

A 128 x 256 tile streams 48 KB from L2 per 64-wide K slice; with two CTAs of a cluster on
vertically adjacent tiles, each loading half of B and multicasting it to both, B's L2 reads
halve (mokgen/cluster.cuh). Three kernels of gemm_test.cu on the same inputs, K-major C = A B^T:
  coop  gemm_plain: the engine as the megakernels run it (tiles from an atomic counter)
  pair  gemm_plain_pair: clusters of 2 on a static pair schedule, each CTA loading all of B
  mc    gemm_plain_mc: the same schedule, B halves multicast to both CTAs of the cluster
and torch.matmul. Checks: fresh random inputs, NaN-poisoned output, fp32 reference
(rel. error <= 1e-2), a bitwise repeat, and pair / mc bitwise equal to coop (every output
element is one warpgroup's wgmma chain in the same K order). Timing: rounds taking turns,
median of `iters` launches each, the best round per kernel; the SM clock and power over the
run (nvidia-smi): the GPU is power-capped under sustained GEMMs (trace.py --clocks).

    python benchmarks/gemm_cluster.py [--cubin .build/gemm_test.cubin] [--iters 30]
Writes $OUT/gemm_cluster.json, a table last."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.gemm_engine import (BK, BM, BN, SMEM, ROOT, Counters, build,  # noqa: E402
                                    rel_err, time_ms)
from mokgen.runtime import cuda as mc  # noqa: E402

SHAPES = [  # (M, N, K): a plain GEMM and the few-large-expert models' GEMMs of one expert
    (16384, 4096, 7168),
    (8192, 28672, 4096),   # Mixtral-8x7B gate/up (N = 2 I)
    (4096, 32768, 6144),   # Mixtral-8x22B gate/up
    (8192, 6144, 16384),   # Mixtral-8x22B down
]


def max_clusters(func, smem: int) -> int:
    """Clusters of 2 that fit on the GPU at once (cuOccupancyMaxActiveClusters)."""
    from cuda.bindings import driver as cu
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = 2 * 66, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = 384, 1, 1
    cfg.sharedMemBytes = smem
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = 2, 1, 1
    cfg.attrs, cfg.numAttrs = [attr], 1
    out = cu.cuOccupancyMaxActiveClusters(func, cfg)
    if out[0] != cu.CUresult.CUDA_SUCCESS:  # the kernel's own __cluster_dims__ alone
        cfg.attrs, cfg.numAttrs = [], 0
        out = cu.cuOccupancyMaxActiveClusters(func, cfg)
    return int(mc.check("cuOccupancyMaxActiveClusters", out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cubin", default=os.path.join(ROOT, ".build/gemm_test.cubin"))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    out_dir = os.environ.get("OUT", os.path.join(ROOT, "benchmarks/results"))
    os.makedirs(out_dir, exist_ok=True)
    if not os.path.exists(a.cubin):
        build(a.cubin)
    mod, counters = mc.load_module(a.cubin), Counters()
    f = {k: mod.function(n, SMEM) for k, n in
         (("coop", "gemm_plain"), ("pair", "gemm_plain_pair"), ("mc", "gemm_plain_mc"))}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    clusters = max_clusters(f["mc"], SMEM)
    res = dict(gpu=torch.cuda.get_device_name(0), clusters=clusters, sms=sms,
               commit=os.environ.get("MOKGEN_COMMIT"), rows=[], checks={})
    print(f"clusters of 2 resident at once: {clusters} ({sms} SMs)", flush=True)
    smi = None
    try:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                                "--format=csv,noheader,nounits", "-lms", "50"],
                               stdout=subprocess.PIPE, text=True)
    except OSError:
        pass
    torch.manual_seed(int(time.time_ns() % (1 << 31)))
    bf = torch.bfloat16
    for M, N, K in SHAPES:
        A = torch.randn(M, K, device="cuda", dtype=bf)
        B = torch.randn(N, K, device="cuda", dtype=bf)
        C = torch.empty(M, N, device="cuda", dtype=bf)
        ta = mc.make_tensor_map_2d(A, M, K, K * 2, BM, BK)
        tb = mc.make_tensor_map_2d(B, N, K, K * 2, BN, BK)
        tb_half = mc.make_tensor_map_2d(B, N, K, K * 2, BN // 2, BK)
        tiles = (M // BM) * (N // BN)
        runs = {
            "coop": lambda: mc.launch(f["coop"], min(sms, tiles), 384, SMEM, None,
                                      [ta, tb, C, M, N, K, N, counters.next()]),
            "pair": lambda: mc.launch(f["pair"], 2 * clusters, 384, SMEM, None,
                                      [ta, tb, C, M, N, K]),
            "mc": lambda: mc.launch(f["mc"], 2 * clusters, 384, SMEM, None,
                                    [ta, tb_half, C, M, N, K]),
        }
        name = f"{M}x{N}x{K}"
        ref = A.float() @ B.float().T
        outs, ok = {}, True
        for k, run in runs.items():  # poison, run twice: error, repeat, against coop
            C.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            first = C.clone()
            C.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            info = dict(rel_err=rel_err(C, ref), repeat=bool(torch.equal(first, C)))
            outs[k] = C.clone()
            if k != "coop":
                info["equal_coop"] = bool(torch.equal(outs["coop"], C))
            info["ok"] = info["rel_err"] <= 1e-2 and info["repeat"] and info.get("equal_coop", True)
            ok &= info["ok"]
            res["checks"][f"{name} {k}"] = info
            print(f"[check] {name} {k}: {info}", flush=True)
        del ref, outs, first
        row = dict(shape=name, M=M, N=N, K=K, flops=2 * M * N * K, ok=ok)
        fns = dict(runs, torch=lambda: torch.matmul(A, B.T))
        for _ in range(a.rounds):
            for k, fn in fns.items():
                ms = time_ms(fn, a.iters)
                row[f"{k}_ms"] = min(ms, row.get(f"{k}_ms", ms))
        for k in fns:
            row[f"{k}_tflops"] = row["flops"] / row[f"{k}_ms"] / 1e9
        res["rows"].append(row)
        print(f"[time] {row}", flush=True)
        del A, B, C
        torch.cuda.empty_cache()
    if smi is not None:
        smi.terminate()
        vals = [[float(v) for v in line.split(",")] for line in smi.communicate()[0].splitlines()
                if line.count(",") == 1]
        if vals:
            res["clock_mhz_median"] = sorted(v[0] for v in vals)[len(vals) // 2]
            res["power_w_median"] = sorted(v[1] for v in vals)[len(vals) // 2]
    with open(os.path.join(out_dir, "gemm_cluster.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"\nclock {res.get('clock_mhz_median')} MHz, power {res.get('power_w_median')} W "
          f"(medians over the run)")
    print("| M x N x K | coop TF | pair TF | mc TF | torch TF | mc/coop | mc/pair | checks |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['shape']} | {r['coop_tflops']:.0f} | {r['pair_tflops']:.0f} | "
              f"{r['mc_tflops']:.0f} | {r['torch_tflops']:.0f} | "
              f"{r['coop_ms'] / r['mc_ms']:.3f} | {r['pair_ms'] / r['mc_ms']:.3f} | "
              f"{'ok' if r['ok'] else 'FAIL'} |")


if __name__ == "__main__":
    main()
