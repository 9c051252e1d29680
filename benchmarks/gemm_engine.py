"""Correctness + timing of the mokgen tensor-core GEMM engine (gemm_tile.cuh) on one GPU, in
both consumer schedules: cooperative (the default) and ping-pong (GemmConfig.pingpong), the
same problems on the same inputs in one process.

Variants (kernels in mokgen/runtime/include/mokgen/tests/gemm_test.cu, each also as *_pp):
  plain    C = A B^T                                  vs torch.matmul
  plain_t  C = A B^T with B MN-major (trans 1, the backward's dgrad) or A and B MN-major
           (trans 2, weight gradients), K = 384 / 768 / 2816 (ep = 8 weight-gradient tiles
           have K ~ 384)                              vs torch.matmul of the same matrices
  swiglu   grouped H = silu(X Wg_e^T) * (X Wu_e^T)    vs torch._grouped_mm + silu*mul
  down     grouped Y = s[row] * (H W2_e^T)            vs torch._grouped_mm * s
Each check uses fresh random normal bf16 inputs, NaN-poisoned outputs and an fp32 reference;
pass = ||y - ref|| / ||ref|| <= 1e-2, a bitwise-identical repeat, and ping-pong bitwise equal
to cooperative (each output element is one warpgroup's wgmma chain in the same K order in
both schedules). Timing: CUDA events around each launch, median of >= 50 after warm-up.
Writes $OUT/gemm_engine.json; table printed last.

  python benchmarks/gemm_engine.py [--cubin .build/gemm_test.cubin] [--iters 50] [--quick]
If --cubin is missing it is built with nvcc (sm_90a).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mokgen.compiler.ir import GemmConfig  # noqa: E402
from mokgen.compiler.lower import smem_bytes  # noqa: E402
from mokgen.runtime import cuda as mc  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SRC = os.path.join(ROOT, "mokgen/runtime/include/mokgen/tests/gemm_test.cu")
BM, BN, BK, STAGES = 128, 256, 64, 4  # must match GemmCfg<256, 4> in gemm_test.cu
SMEM = smem_bytes(GemmConfig(BM, BN, STAGES))
TOL = 1e-2
SCHEDULES = {"coop": "", "pp": "_pp"}  # kernel name suffix of each consumer schedule


def build(cubin: str) -> str:
    os.makedirs(os.path.dirname(cubin) or ".", exist_ok=True)
    cmd = ["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-cubin",
           "-DMOKGEN_SPIN_LIMIT=(1u<<22)",  # a hang traps in well under a second
           "-Xptxas", "-v", "-I", os.path.join(ROOT, "mokgen/runtime/include"), SRC, "-o", cubin]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return r.stderr


class Engine:
    """One schedule's kernels (suffix "" or "_pp"); the counters are shared."""

    def __init__(self, mod, suffix: str, counters):
        names = ("gemm_plain", "gemm_plain_t", "gemm_swiglu", "gemm_down")
        self.f = {n: mod.function(n + suffix, SMEM) for n in names}
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.counters = counters

    def counter(self):
        return self.counters.next()

    def plain(self, A, B, C):
        M, K = A.shape
        N = B.shape[0]
        ta = mc.make_tensor_map_2d(A, M, K, K * 2, BM, BK)
        tb = mc.make_tensor_map_2d(B, N, K, K * 2, BN, BK)
        tiles = -(-M // BM) * (N // BN)
        def run():
            mc.launch(self.f["gemm_plain"], min(self.sms, tiles), 384, SMEM, None,
                      [ta, tb, C, M, N, K, N, self.counter()])
        return run

    def plain_t(self, A, B, C, trans):
        """C = A B^T; trans 1: B given as Bt [K, N]; trans 2: also A as At [K, M]."""
        M, K = A.shape
        N = B.shape[0]
        At = A.T.contiguous() if trans == 2 else None
        Bt = B.T.contiguous()
        ta = (mc.make_tensor_map_2d(At, K, M, M * 2, 64, 64) if trans == 2
              else mc.make_tensor_map_2d(A, M, K, K * 2, BM, BK))
        tb = mc.make_tensor_map_2d(Bt, K, N, N * 2, 64, 64)
        tiles = -(-M // BM) * -(-N // BN)
        def run():
            mc.launch(self.f["gemm_plain_t"], min(self.sms, tiles), 384, SMEM, None,
                      [ta, tb, C, M, N, K, N, self.counter(), trans])
        run.keep = (At, Bt)  # the maps hold their addresses
        return run

    def swiglu(self, X, W13, offs, I, H):
        M, D = X.shape
        E = offs.numel() - 1
        tx = mc.make_tensor_map_2d(X, M, D, D * 2, BM, BK)
        tw = mc.make_tensor_map_2d(W13, W13.shape[0], D, D * 2, BN // 2, BK)
        tiles = m_tiles(offs) * (I // (BN // 2))
        def run():
            mc.launch(self.f["gemm_swiglu"], min(self.sms, tiles), 384, SMEM, None,
                      [tx, tw, offs, E, D, I, H, tiles, self.counter()])
        return run

    def down(self, Hin, W2, offs, D, scale, Y):
        M, I = Hin.shape
        E = offs.numel() - 1
        th = mc.make_tensor_map_2d(Hin, M, I, I * 2, BM, BK)
        tw = mc.make_tensor_map_2d(W2, W2.shape[0], I, I * 2, BN, BK)
        tiles = m_tiles(offs) * (D // BN)
        def run():
            mc.launch(self.f["gemm_down"], min(self.sms, tiles), 384, SMEM, None,
                      [th, tw, offs, E, I, D, scale, Y, tiles, self.counter()])
        return run


class Counters:
    """One fresh zeroed tile counter per launch: no reset kernel inside the timed region."""

    def __init__(self):
        self.buf = torch.zeros(1 << 14, dtype=torch.int32, device="cuda")
        self.i = 0

    def next(self):
        if self.i == self.buf.numel():
            self.buf.zero_()
            self.i = 0
        self.i += 1
        return mc.Ptr(self.buf.data_ptr() + 4 * (self.i - 1))


def m_tiles(offs) -> int:
    o = offs.tolist()
    return sum(-(-(o[e + 1] - o[e]) // BM) for e in range(len(o) - 1))


def segments(M: int, E: int, gen, unit: int = BM) -> torch.Tensor:
    """Uneven contiguous expert segments of multiples of `unit` rows summing to M (some may be
    empty), as int32 offsets [E+1] on the GPU."""
    blocks = M // unit
    w = torch.empty(E).exponential_(generator=gen)
    cnt = torch.floor(w / w.sum() * blocks).long()
    cnt[torch.argmax(w)] += blocks - int(cnt.sum())
    offs = torch.zeros(E + 1, dtype=torch.int32)
    offs[1:] = torch.cumsum(cnt * unit, 0)
    offs[-1] = M  # a ragged tail (M not a multiple of unit) goes to the last expert
    return offs.cuda()


def rel_err(y, ref) -> float:
    y = y.float()
    if not torch.isfinite(y).all():
        return float("nan")
    return ((y - ref).norm() / ref.norm()).item()


def time_ms(fn, iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(iters)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def poisoned_twice(run, out) -> bool:
    """`run` into a NaN-poisoned `out` twice (the second run's result stays in `out`): whether
    both runs wrote the same bits."""
    out.fill_(float("nan"))
    run()
    torch.cuda.synchronize()
    first = out.clone()
    out.fill_(float("nan"))
    run()
    torch.cuda.synchronize()
    return bool(torch.equal(first, out))


def check(name, runs, out, ref, results):
    """Each schedule: poison, run twice, compare with the reference and between runs; then the
    schedules with each other (bitwise)."""
    outs = {}
    for sched, run in runs.items():
        det = poisoned_twice(run, out)
        err = rel_err(out, ref)
        info = {"rel_err": err, "deterministic": det, "ok": err <= TOL and det}
        if not info["ok"]:  # where it goes wrong, for debugging without a second GPU session
            d = (out.float() - ref).abs().nan_to_num(1e30)
            r, c = divmod(int(d.argmax()), d.shape[1])
            bad_rows = (d.amax(1) > 1e-2 * ref.abs().amax()).nonzero().flatten()
            info.update(worst=[r, c, out[r, c].item(), ref[r, c].item()],
                        bad_rows=int(bad_rows.numel()), first_bad_rows=bad_rows[:8].tolist())
        outs[sched] = out.clone()
        results[f"{name} [{sched}]"] = info
        print(f"[check] {name} [{sched}]: {info}", flush=True)
    if len(outs) == 2:
        same = bool(torch.equal(outs["coop"], outs["pp"]))
        results[f"{name} [pp == coop]"] = {"ok": same}
        print(f"[check] {name} [pp == coop bitwise]: {same}", flush=True)
    return all(v["ok"] for k, v in results.items() if k.startswith(name + " ["))


def timed(res, name, flops, runs, iters, torch_fn=None, torch_impl="", dense_fn=None):
    """One table row: each schedule's ms (the better of two medians, the schedules taking
    turns), torch's (and a dense cuBLAS GEMM of the same FLOPs)."""
    entry = {"name": name, "flops": flops}
    for _ in range(2):
        for sched, run in runs.items():
            ms = time_ms(run, iters)
            entry[f"{sched}_ms"] = min(ms, entry.get(f"{sched}_ms", ms))
    for key, fn in (("torch", torch_fn), ("dense", dense_fn)):
        if fn is None:
            continue
        try:
            entry[f"{key}_ms"] = time_ms(fn, iters)
        except Exception as ex:  # noqa: BLE001
            entry[f"{key}_error"] = repr(ex)[:200]
    if torch_fn is not None:
        entry["torch_impl"] = torch_impl
    for k in ("coop", "pp", "torch", "dense"):
        if f"{k}_ms" in entry:
            entry[f"{k}_tflops"] = flops / entry[f"{k}_ms"] / 1e9
    res["timing"].append(entry)
    print(f"[time] {entry}", flush=True)


def grouped_ref(X, W, offs, fn):
    o = offs.tolist()
    outs = []
    for e in range(len(o) - 1):
        if o[e + 1] > o[e]:
            outs.append(fn(X[o[e]:o[e + 1]].float(), e))
    return torch.cat(outs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cubin", default=os.path.join(ROOT, ".build/gemm_test.cubin"))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--M", type=int, default=16384)
    ap.add_argument("--D", type=int, default=7168)
    ap.add_argument("--I", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="the checks and the K = 384 rows only")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", os.path.join(ROOT, "benchmarks/results"))
    os.makedirs(out_dir, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ptxas = None
    if not os.path.exists(args.cubin):
        ptxas = build(args.cubin)
    elif os.path.exists(args.cubin + ".ptxas.txt"):
        ptxas = open(args.cubin + ".ptxas.txt").read()
    mod, counters = mc.load_module(args.cubin), Counters()
    engines = {k: Engine(mod, sfx, counters) for k, sfx in SCHEDULES.items()}
    seed = int(time.time_ns() % (1 << 31))
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "seed": seed,
           "sms": engines["coop"].sms, "smem_bytes": SMEM, "tile": [BM, BN, BK, STAGES],
           "checks": {}, "timing": [], "ptxas": ptxas}
    try:
        body(args, engines, gen, res)
    except Exception as ex:  # noqa: BLE001 - keep the partial results (a trap kills the context)
        res["error"] = repr(ex)[:500]
        print("ERROR:", res["error"], flush=True)
    report(res, out_dir)


def body(args, engines, gen, res):
    dev = "cuda"
    bf = torch.bfloat16
    M, D, I = args.M, args.D, args.I
    rn = lambda *s: torch.randn(*s, device=dev, dtype=bf)  # noqa: E731
    each = lambda f, *a: {k: getattr(e, f)(*a) for k, e in engines.items()}  # noqa: E731

    # ---------------- small, ragged correctness cases (M, K tails; non-multiple segments)
    A, B = rn(1000, 200), rn(512, 200)
    C = torch.empty(1000, 512, device=dev, dtype=bf)
    check("plain_ragged_M1000_N512_K200", each("plain", A, B, C), C, A.float() @ B.float().T,
          res["checks"])
    for trans in (1, 2):  # N = 600: an edge tile; K = 200: a K tail
        A, B = rn(1000, 200), rn(600, 200)
        C = torch.empty(1000, 600, device=dev, dtype=bf)
        check(f"plain_t{trans}_ragged_M1000_N600_K200", each("plain_t", A, B, C, trans), C,
              A.float() @ B.float().T, res["checks"])
    A, B = rn(1000, 64), rn(512, 64)  # one K block: the shortest mainloop
    C = torch.empty(1000, 512, device=dev, dtype=bf)
    check("plain_M1000_N512_K64", each("plain", A, B, C), C, A.float() @ B.float().T,
          res["checks"])
    offs = segments(1000, 5, gen, unit=16)  # segments NOT multiples of BM
    Xs, W13s, Hs = rn(1000, 512), rn(5 * 2 * 256, 512), torch.empty(1000, 256, device=dev, dtype=bf)
    ref = grouped_ref(Xs, W13s, offs, lambda x, e: F.silu(x @ W13s[e * 512:e * 512 + 256].float().T)
                      * (x @ W13s[e * 512 + 256:(e + 1) * 512].float().T))
    check("swiglu_ragged_segments", each("swiglu", Xs, W13s, offs, 256, Hs), Hs, ref,
          res["checks"])

    # ---------------- weight-gradient-like (short K) and dgrad-like transposed GEMMs
    shapes = [(D, I, 384, 2), (2 * I, D, 384, 2), (D, I, 384, 1), (D, I, 384, 0),
              (D, I, 768, 2), (D, I, 2816, 2)]
    if not args.quick:
        shapes += [(M, I, D, 1), (M, D, 2 * I, 1)]
    for m, n, k, trans in shapes:
        A, B = rn(m, k), rn(n, k)
        C = torch.empty(m, n, device=dev, dtype=bf)
        runs = each("plain_t", A, B, C, trans) if trans else each("plain", A, B, C)
        name = f"t{trans} {m}x{n}x{k}"
        check(name, runs, C, A.float() @ B.float().T, res["checks"])
        timed(res, name, 2 * m * n * k, runs, args.iters, lambda: A @ B.T, "torch.matmul")
        del A, B, C
    if args.quick:
        return

    # ---------------- plain, big
    A, B = rn(M, D), rn(2 * I, D)
    C = torch.empty(M, 2 * I, device=dev, dtype=bf)
    runs = each("plain", A, B, C)
    check(f"plain_{M}x{2*I}x{D}", runs, C, A.float() @ B.float().T, res["checks"])
    timed(res, f"plain {M}x{2*I}x{D}", 2 * M * 2 * I * D, runs, args.iters,
          lambda: torch.matmul(A, B.T), "torch.matmul")
    del A, B, C

    # ---------------- grouped (experts)
    for E in (6, 48):
        offs = segments(M, E, gen)
        res["checks"][f"segments_E{E}"] = (offs[1:] - offs[:-1]).tolist()
        X = rn(M, D)
        W13 = rn(E * 2 * I, D)
        H = torch.empty(M, I, device=dev, dtype=bf)
        runs = each("swiglu", X, W13, offs, I, H)
        ref = grouped_ref(X, W13, offs, lambda x, e: F.silu(
            x @ W13[e * 2 * I:e * 2 * I + I].float().T) * (x @ W13[e * 2 * I + I:(e + 1) * 2 * I].float().T))
        check(f"swiglu_E{E}", runs, H, ref, res["checks"])
        del ref
        w13t = W13.view(E, 2 * I, D).transpose(1, 2)
        gofs = offs[1:].contiguous()

        def torch_swiglu():
            y = torch._grouped_mm(X, w13t, offs=gofs)
            return F.silu(y[:, :I]) * y[:, I:]
        timed(res, f"swiglu E={E} {M}x{I}(x2)x{D}", 2 * M * 2 * I * D, runs, args.iters,
              torch_swiglu, "_grouped_mm + silu*mul", lambda: torch.matmul(X, W13[:2 * I].T))
        del W13, w13t

        Hin = rn(M, I)
        W2 = rn(E * D, I)
        scale = torch.rand(M, device=dev, dtype=torch.float32)
        Y = torch.empty(M, D, device=dev, dtype=bf)
        runs = each("down", Hin, W2, offs, D, scale, Y)
        ref = grouped_ref(Hin, W2, offs, lambda h, e: h @ W2[e * D:(e + 1) * D].float().T) * scale[:, None]
        check(f"down_E{E}", runs, Y, ref, res["checks"])
        del ref
        w2t = W2.view(E, D, I).transpose(1, 2)
        timed(res, f"down E={E} {M}x{D}x{I}", 2 * M * D * I, runs, args.iters,
              lambda: torch._grouped_mm(Hin, w2t, offs=gofs) * scale[:, None],
              "_grouped_mm * scale", lambda: torch.matmul(Hin, W2[:D].T))
        del X, Hin, W2, w2t, H, Y
        torch.cuda.empty_cache()


def report(res, out_dir):
    with open(os.path.join(out_dir, "gemm_engine.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print("\n%-34s %8s %8s %8s %8s %8s %8s %8s %7s" % (
        "variant (TFLOP/s; ms)", "coop ms", "pp ms", "torch ms", "coop TF", "pp TF",
        "torch TF", "dense TF", "pp/coop"))
    for t in res["timing"]:
        g = lambda k: t.get(k, float("nan"))  # noqa: E731
        print("%-34s %8.3f %8.3f %8.3f %8.1f %8.1f %8.1f %8.1f %7.3f" % (
            t["name"], g("coop_ms"), g("pp_ms"), g("torch_ms"), g("coop_tflops"),
            g("pp_tflops"), g("torch_tflops"), g("dense_tflops"), g("coop_ms") / g("pp_ms")))
    bad = [k for k, v in res["checks"].items() if isinstance(v, dict) and not v["ok"]]
    print("checks:", "ALL PASS" if not bad else f"FAIL {bad}")


if __name__ == "__main__":
    main()
