"""Two engine experiments for #16 / #17, each against the engine as the megakernels run it
(gemm_test.cu's kernels, same inputs, one process):

pairs: does sharing B between the two CTAs of a cluster pay? A 128 x 256 tile streams 48 KB
from L2 per 64-wide K slice; with two CTAs of a cluster on vertically adjacent tiles, each
loading half of B and multicasting it to both, B's L2 reads halve (mokgen/cluster.cuh).
  coop  gemm_plain: tiles from an atomic counter, cooperative consumers
  pair  gemm_plain_pair: clusters of 2 on a static pair schedule, each CTA loading all of B
  mc    gemm_plain_mc: the same schedule, B halves multicast to both CTAs of the cluster
pt: does ping-pong on whole tasks hide the epilogue? Each consumer warpgroup runs every other
128 x 128 task end to end (gemm_plain_pt, gemm_plain_t2_pt; pt4 the same with the megakernels'
4 stages in place of 6: does ring depth hold one warpgroup's chains below the tensor rate?),
and 128 x 192 ones where N allows (pt192: QuACK's sm_90 ping-pong tile, SonicMoE's GEMMs),
against coop (128 x 256) and the
half-task ping-pong (pp, GemmConfig.pingpong), on long-K K-major GEMMs and short-K
weight-gradient-like ones (both operands MN-major). On the latter also the engine's solo
tasks (GemmCfg::SOLO, gemm_mixed_t2): every task solo, and half the m-blocks cooperative
beside solo ones (mixed), in the engine's persistent driver with an atomic counter.
Every kernel's epilogue is the test kernels' (bf16 pairs stored from registers), the same per
output element, so the schedules compare; the megakernels' own epilogues differ.
Checks: fresh random inputs, NaN-poisoned output, fp32 reference (rel. error <= 1e-2) and a
bitwise repeat; whether each is bitwise equal to coop is reported (each output element is one
warpgroup's wgmma chain in the same K order: equal unless the MMA shape changes the sums).
Timing: rounds taking turns, the median of `iters` launches, the best round per kernel; the
SM clock and power over the run (nvidia-smi): the GPU is power-capped under sustained GEMMs
(trace.py --clocks). A few dozen launches can end before the cap bites, so `--sustained S`
also runs each pair kernel back to back for S seconds and reports its settled time a call,
clock and power (trace.clocks): whether multicast's halved L2 reads buy clock under the cap
(#16), which the short loops cannot show.

    python benchmarks/gemm_experiments.py [--cubin .build/gemm_test.cubin] [--iters 30]
Writes $OUT/gemm_experiments.json, the tables last."""
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
                                    poisoned_twice, rel_err, time_ms)
from mokgen.compiler.ir import GemmConfig  # noqa: E402
from mokgen.compiler.lower import smem_bytes  # noqa: E402
from mokgen.runtime import cuda as mc  # noqa: E402

PAIR_SHAPES = [  # (M, N, K): a plain GEMM and the few-large-expert models' GEMMs of one expert
    (16384, 4096, 7168),
    (8192, 28672, 4096),   # Mixtral-8x7B gate/up (N = 2 I)
    (4096, 32768, 6144),   # Mixtral-8x22B gate/up
    (8192, 6144, 16384),   # Mixtral-8x22B down
]
PT_SHAPES = [  # (M, N, K, layout): 0 K-major, 2 both MN-major (a weight gradient's)
    (16384, 4096, 7168, 0),
    (8192, 28672, 4096, 0),
    (7168, 2048, 384, 2),    # kimi ep 8: an expert's ~350 rows
    (4096, 14336, 1024, 2),  # Mixtral-8x7B dW2 (D x I, K = an expert's 1,024 rows)
    (28672, 4096, 1024, 2),  # Mixtral-8x7B dW1 (2I x D)
    # N a multiple of 192 and of 256 (pt192 runs too)
    (16384, 6144, 7168, 0),
    (8192, 1536, 2048, 0),   # Qwen3-30B gate/up rows (N = 2 I, K = D)
    (2048, 1536, 512, 2),    # Qwen3-30B dW1 (transposed: D x 2I), K = an expert's ~512 rows
    (2048, 768, 512, 2),     # Qwen3-30B dW2 (D x I)
    (8192, 2048, 768, 0),    # Qwen3-30B down rows (N = D, K = I): the forward's down tiles
]


# gemm_test.cu's PtCfg<tn, stages> = GemmCfg<tn, stages>
SOLO_SMEM = smem_bytes(GemmConfig(128, BN, 4, solo=True))  # gemm_test.cu SoloCfg
PT_SMEM, PT4_SMEM, PT192_SMEM = (smem_bytes(GemmConfig(128, tn, st))
                                 for tn, st in ((128, 6), (128, 4), (192, 5)))


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


def check_and_time(name, runs, C, ref, res, a):
    """Poison, run twice: error, repeat and equality with the first run's kernel (coop); then
    `a.rounds` rounds of every run (torch last) taking turns: the row."""
    outs, ok = {}, True
    for k, run in runs.items():
        if k == "torch":
            continue
        repeat = poisoned_twice(run, C)
        info = dict(rel_err=rel_err(C, ref), repeat=repeat)
        if outs:
            info["equal_coop"] = bool(torch.equal(outs["coop"], C))
        outs.setdefault("coop", C.clone())
        info["ok"] = info["rel_err"] <= 1e-2 and info["repeat"]  # equal_coop: reported
        ok &= info["ok"]
        res["checks"][f"{name} {k}"] = info
        print(f"[check] {name} {k}: {info}", flush=True)
    del outs
    row = dict(shape=name, ok=ok)
    for _ in range(a.rounds):
        for k, fn in runs.items():
            ms = time_ms(fn, a.iters)
            row[f"{k}_ms"] = min(ms, row.get(f"{k}_ms", ms))
    print(f"[time] {row}", flush=True)
    return row


def pairs(f, sms, clusters, counters, res, a):
    bf = torch.bfloat16
    for M, N, K in PAIR_SHAPES:
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
            "torch": lambda: torch.matmul(A, B.T),
        }
        row = check_and_time(f"{M}x{N}x{K}", runs, C, A.float() @ B.float().T, res, a)
        row["flops"] = 2 * M * N * K
        if a.sustained > 0:  # under the power cap: each kernel back to back for a while
            from benchmarks.trace import clocks
            order = ("coop", "pair", "mc")  # then mirrored (ABBA: the board warms as it runs)
            got = clocks([(k, runs[k]) for k in order] +
                         [(k + "'", runs[k]) for k in reversed(order)], a.sustained)
            print(f"[sustained] {got}", flush=True)
            row["sustained"] = {k: {f: (got[k][f] + got[k + "'"][f]) / 2
                                    for f in ("ms", "mhz", "watts") if f in got.get(k, {})
                                    and f in got.get(k + "'", {})} for k in order}
        res["pairs"].append(row)
        del A, B, C
        torch.cuda.empty_cache()


def pt(f, sms, counters, res, a):
    bf = torch.bfloat16
    for M, N, K, tr in PT_SHAPES:
        A = torch.randn(M, K, device="cuda", dtype=bf)
        B = torch.randn(N, K, device="cuda", dtype=bf)
        C = torch.empty(M, N, device="cuda", dtype=bf)
        if tr == 2:
            At, Bt = A.T.contiguous(), B.T.contiguous()
            ta = mc.make_tensor_map_2d(At, K, M, M * 2, 64, 64)
            tb = mc.make_tensor_map_2d(Bt, K, N, N * 2, 64, 64)
            ta_pt, tb_pt = ta, tb
            tb192 = tb  # 64 x 64 boxes, three a slice
            def coop(fn, grid=min(sms, (M // BM) * (N // BN))):
                return lambda: mc.launch(f[fn], grid, 384, SMEM, None,
                                         [ta, tb, C, M, N, K, N, counters.next(), 2])
            runs = {"coop": coop("coop_t"), "pp": coop("pp_t")}
            pt_fn, pt4_fn, pt192_fn = f["pt_t2"], f["pt4_t2"], f["pt192_t2"]
            for k, m_coop in (("solo", 0), ("mixed", M // 256)):  # the engine's solo tasks
                runs[k] = (lambda m_coop: lambda: mc.launch(
                    f["mixed"], sms, 384, SOLO_SMEM, None,
                    [ta, tb, C, M, N, K, m_coop, counters.next()]))(m_coop)
        else:
            ta = mc.make_tensor_map_2d(A, M, K, K * 2, BM, BK)
            tb = mc.make_tensor_map_2d(B, N, K, K * 2, BN, BK)
            ta_pt = ta
            tb_pt = mc.make_tensor_map_2d(B, N, K, K * 2, 128, BK)
            tb192 = mc.make_tensor_map_2d(B, N, K, K * 2, 192, BK) if N % 192 == 0 else None
            def coop(fn, grid=min(sms, (M // BM) * (N // BN))):
                return lambda: mc.launch(f[fn], grid, 384, SMEM, None,
                                         [ta, tb, C, M, N, K, N, counters.next()])
            runs = {"coop": coop("coop"), "pp": coop("pp")}
            pt_fn, pt4_fn, pt192_fn = f["pt"], f["pt4"], f["pt192"]
        runs["pt"] = lambda: mc.launch(pt_fn, min(sms, (M // 128) * (N // 128)), 384, PT_SMEM,
                                       None, [ta_pt, tb_pt, C, M, N, K])
        runs["pt4"] = lambda: mc.launch(pt4_fn, min(sms, (M // 128) * (N // 128)), 384,
                                        PT4_SMEM, None, [ta_pt, tb_pt, C, M, N, K])
        if N % 192 == 0:
            runs["pt192"] = lambda: mc.launch(pt192_fn, min(sms, (M // 128) * (N // 192)), 384,
                                              PT192_SMEM, None, [ta_pt, tb192, C, M, N, K])
        runs["torch"] = lambda: torch.matmul(A, B.T)
        row = check_and_time(f"t{tr} {M}x{N}x{K}", runs, C, A.float() @ B.float().T, res, a)
        row["flops"] = 2 * M * N * K
        res["pt"].append(row)
        del A, B, C
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cubin", default=os.path.join(ROOT, ".build/gemm_test.cubin"))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="pairs,pt")
    ap.add_argument("--sustained", type=float, default=0.0,
                    help="seconds each pair kernel runs back to back for its settled rate, "
                         "clock and power (0: not)")
    a = ap.parse_args()
    out_dir = os.environ.get("OUT", os.path.join(ROOT, "benchmarks/results"))
    os.makedirs(out_dir, exist_ok=True)
    if not os.path.exists(a.cubin):
        build(a.cubin)
    mod, counters = mc.load_module(a.cubin), Counters()
    names = dict(coop="gemm_plain", pp="gemm_plain_pp", coop_t="gemm_plain_t",
                 pp_t="gemm_plain_t_pp", pair="gemm_plain_pair", mc="gemm_plain_mc")
    f = {k: mod.function(n, SMEM) for k, n in names.items()}
    f.update(mixed=mod.function("gemm_mixed_t2", SOLO_SMEM),
             pt=mod.function("gemm_plain_pt", PT_SMEM),
             pt_t2=mod.function("gemm_plain_t2_pt", PT_SMEM),
             pt4=mod.function("gemm_plain_pt4", PT4_SMEM),
             pt4_t2=mod.function("gemm_plain_t2_pt4", PT4_SMEM),
             pt192=mod.function("gemm_plain_pt192", PT192_SMEM),
             pt192_t2=mod.function("gemm_plain_t2_pt192", PT192_SMEM))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    clusters = max_clusters(f["mc"], SMEM)
    res = dict(gpu=torch.cuda.get_device_name(0), clusters=clusters, sms=sms,
               commit=os.environ.get("MOKGEN_COMMIT"), pairs=[], pt=[], checks={})
    print(f"clusters of 2 resident at once: {clusters} ({sms} SMs)", flush=True)
    smi = None
    try:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                                "--format=csv,noheader,nounits", "-lms", "50"],
                               stdout=subprocess.PIPE, text=True)
    except OSError:
        pass
    torch.manual_seed(int(time.time_ns() % (1 << 31)))
    try:
        if "pt" in a.only.split(","):
            pt(f, sms, counters, res, a)
        if "pairs" in a.only.split(","):
            pairs(f, sms, clusters, counters, res, a)
    except Exception as ex:  # noqa: BLE001 - keep the rows so far (a trap kills the context)
        res["error"] = repr(ex)[:500]
        print("ERROR:", res["error"], flush=True)
    if smi is not None:
        smi.terminate()
        vals = [[float(v) for v in line.split(",")] for line in smi.communicate()[0].splitlines()
                if line.count(",") == 1]
        if vals:
            res["clock_mhz_median"] = sorted(v[0] for v in vals)[len(vals) // 2]
            res["power_w_median"] = sorted(v[1] for v in vals)[len(vals) // 2]
    for rows in (res["pairs"], res["pt"]):
        for r in rows:
            for k in [k[:-3] for k in r if k.endswith("_ms")]:
                r[f"{k}_tflops"] = r["flops"] / r[f"{k}_ms"] / 1e9
    with open(os.path.join(out_dir, "gemm_experiments.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"\nclock {res.get('clock_mhz_median')} MHz, power {res.get('power_w_median')} W "
          f"(medians over the run)")
    tf = lambda r, k: f"{r.get(k + '_tflops', float('nan')):.0f}"  # noqa: E731
    if res["pt"]:
        print("| GEMM | coop TF | pp TF | pt TF | pt4 TF | pt192 TF | solo TF | mixed TF | "
              "torch TF | pt/coop | pt4/pt | pt192/coop | solo/coop | checks |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        def ratio(r, k):
            return r["coop_ms"] / r[f"{k}_ms"] if f"{k}_ms" in r else float("nan")
        for r in res["pt"]:
            print(f"| {r['shape']} | {tf(r, 'coop')} | {tf(r, 'pp')} | {tf(r, 'pt')} | "
                  f"{tf(r, 'pt4')} | {tf(r, 'pt192')} | {tf(r, 'solo')} | {tf(r, 'mixed')} | "
                  f"{tf(r, 'torch')} | {ratio(r, 'pt'):.3f} | "
                  f"{r['pt_ms'] / r['pt4_ms']:.3f} | {ratio(r, 'pt192'):.3f} | "
                  f"{ratio(r, 'solo'):.3f} | {'ok' if r['ok'] else 'FAIL'} |")
    if res["pairs"]:
        print("| M x N x K | coop TF | pair TF | mc TF | torch TF | mc/coop | mc/pair | checks |")
        print("|---|---|---|---|---|---|---|---|")
        for r in res["pairs"]:
            print(f"| {r['shape']} | {tf(r, 'coop')} | {tf(r, 'pair')} | {tf(r, 'mc')} | "
                  f"{tf(r, 'torch')} | {r['coop_ms'] / r['mc_ms']:.3f} | "
                  f"{r['pair_ms'] / r['mc_ms']:.3f} | {'ok' if r['ok'] else 'FAIL'} |")
        if any("sustained" in r for r in res["pairs"]):
            print("\nsustained (back to back, settled, mean of two mirrored runs): TF / MHz / W")
            print("| M x N x K | coop | pair | mc | mc/coop | mc/pair |")
            print("|---|---|---|---|---|---|")
            for r in res["pairs"]:
                s = r.get("sustained", {})
                def cell(k):
                    v = s.get(k, {})
                    return (f"{r['flops'] / v['ms'] / 1e9:.0f} / {v.get('mhz', 0):.0f} / "
                            f"{v.get('watts', 0):.0f}") if "ms" in v else "-"
                def rat(k):
                    return (f"{s[k]['ms'] / s['mc']['ms']:.3f}"
                            if "ms" in s.get(k, {}) and "ms" in s.get("mc", {}) else "-")
                print(f"| {r['shape']} | {cell('coop')} | {cell('pair')} | {cell('mc')} | "
                      f"{rat('coop')} | {rat('pair')} |")


if __name__ == "__main__":
    main()
