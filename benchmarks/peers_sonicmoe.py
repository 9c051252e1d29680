"""How does mokgen compare with SonicMoE? One GPU, the whole layer at ep = 1, each with its own
softmax top-k router, the same input tokens and output gradient: forward and training step
(forward + backward) TFLOP/s = 6 T k D I / t (x 3 for the step), and the peak memory of a
step above what was allocated before the layer was built, its weights and their gradients
excluded (workspace included). The step is timed twice: adding into the gradients of the
steps before (gradient accumulation), and with them set to None before each step, as
PyTorch's default `optimizer.zero_grad()` leaves them (the `*_fresh` columns: autograd then
adds nothing, for either layer). mokgen runs twice: with fuse_grad_accumulation=False
(autograd adds the expert gradients, as it does SonicMoE's: the `mokgen_*` columns) and
=True (the kernel adds them into .grad: `mokgen_fused_*`, the default in one process; with
no .grad to add into it is the other's path, so it has no fresh column). --sustained S also
runs the forward and the step back to back for S seconds each, at the power cap (the
`*_sustained_*` columns). --dtypes bf16,fp8 also runs mokgen's blockwise fp8 layers the same
two ways, into the same columns named `mokgen_fp8_*` (SonicMoE runs bf16 only). Each timed
step marks the weights changed, as an optimizer step between training steps does, so a layer
that caches anything derived from its weights (mokgen's fp8 quantized weights) pays for
making it again in every step; the forward alone reuses it (inference).

    python benchmarks/peers_sonicmoe.py [--shapes qwen3-30b-a3b,...] [--dtypes bf16,fp8]
        [--sustained 2] [--out DIR]
    python benchmarks/peers_sonicmoe.py --prebuild [--dtypes ...]   (no GPU: mokgen's kernels
        into $MOKGEN_CACHE)

SonicMoE (the sonic-moe package) is installed on the GPU machine from wheels fetched here:
benchmarks/peers/README.md. Its first call per shape JIT-compiles for minutes; QuACK keeps
the compiled kernels in $QUACK_CACHE_DIR, which benchmarks/run_gpu.sh carries between calls.
Where sonicmoe does not import, the rows hold mokgen's numbers and None for SonicMoE's.
Rows go into DIR/peers_sonicmoe.json (rows per GPU kind, benchmarks/result_file.py) and
DIR/peers_sonicmoe.png (this run's); a table is printed.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
from torch.autograd.graph import increment_version

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import mokgen  # noqa: E402
from mokgen.harness.bench import sustained_ms, time_ms  # noqa: E402

import result_file  # noqa: E402

SHAPES = [  # (name, T, D, I, E, k): four public models' layers and SonicMoE's README example
    ("qwen3-30b-a3b", 8192, 2048, 768, 128, 8),
    ("olmoe-1b-7b", 8192, 2048, 1024, 64, 8),
    ("qwen3-235b-a22b", 16384, 4096, 1536, 128, 8),
    ("mixtral-8x7b", 8192, 4096, 14336, 8, 2),
    ("sonicmoe-readme", 32768, 4096, 1024, 128, 8),
]


def sonicmoe_layer(D, I, E, k):
    """SonicMoE's layer and its call, or None where the package is missing."""
    try:
        from sonicmoe import KernelBackendMoE, MoE
        from sonicmoe.enums import ActivationType
    except ImportError as e:
        print(f"sonicmoe not importable ({e}): its columns stay empty", flush=True)
        return None
    layer = MoE(num_experts=E, num_experts_per_tok=k, hidden_size=D, intermediate_size=I,
                activation_function=ActivationType.SWIGLU, add_bias=False,
                std=0.02).to("cuda", torch.bfloat16)
    return layer, lambda x: layer(x, kernel_backend_moe=KernelBackendMoE.sonicmoe)[0]


def mokgen_shape(D, I, E, k):
    return mokgen.MoEShape(E, D, I, k, shared_experts=0)


def mokgen_layer(D, I, E, k, T, fuse=False, dtype="bf16"):
    # .to(bf16) as SonicMoE's layer above (its router included): the user's model dtype
    layer = mokgen.MoE(mokgen_shape(D, I, E, k), tokens_per_rank=T, dtype=dtype,
                       fuse_grad_accumulation=fuse, device="cuda").to(torch.bfloat16)
    return layer, layer


def prebuild(shapes, dtypes=("bf16",)) -> None:
    """Compile the kernels mokgen.MoE builds for `shapes` (its plan: ep = 1, tuned overrides)."""
    from mokgen.pytorch.api import build_plans
    from mokgen.compiler.tuned import tuned_plan
    bins = build_plans([tuned_plan(mokgen_shape(D, I, E, k), 1, dt, T)
                        for _, T, D, I, E, k in shapes for dt in dtypes], jobs=os.cpu_count())
    print(f"prebuild: {len(bins)} kernels, {sum(not b.cached for b in bins)} built")


def measure(make, T, D, iters, sustained=0.0, extra=None):
    """-> (forward ms, training step ms, peak MB, and the step's ms and peak MB again with
    the gradients set to None before it) of the layer `make()` builds, or Nones. With
    `sustained` seconds and an `extra` dict: also the forward's and the (accumulating) step's
    ms a call run back to back that long, once the power cap has set the clock
    (mokgen.harness.bench.sustained_ms; the synced calls above leave the GPU idle between them),
    as extra["fwd_sustained_ms"] and extra["train_sustained_ms"]."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    base = torch.cuda.memory_allocated()
    built = make()
    if built is None:
        return None, None, None, None, None
    layer, call = built
    params = sum(p.numel() * p.element_size() for p in layer.parameters())

    weights = list(layer.parameters())

    def step():
        for w in weights:  # what an optimizer step does to them (in place: a new version)
            increment_version(w)
        xg = x.detach().requires_grad_()
        call(xg).backward(dy)

    t0 = time.perf_counter()
    with torch.no_grad():
        fwd = time_ms(lambda: call(x), iters, warmup=3)
    print(f"  built and first forward calls in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    step()  # the first backward: SonicMoE JIT-compiles its backward kernels here
    torch.cuda.synchronize()
    print(f"  first training step in {time.perf_counter() - t0:.0f} s", flush=True)
    train = time_ms(step, iters, warmup=3)  # gradients exist from here on: counted as the weights' own
    peak = peak_mb(step, base, params)
    if sustained > 0 and extra is not None:
        with torch.no_grad():
            extra["fwd_sustained_ms"] = sustained_ms(lambda: call(x), sustained)
        extra["train_sustained_ms"] = sustained_ms(step, sustained)

    def fresh():  # optimizer.zero_grad()'s default: no gradient to add into
        layer.zero_grad(set_to_none=True)
    train_fresh = time_ms(step, iters, warmup=3, setup=fresh)
    fresh()
    peak_fresh = peak_mb(step, base, params)
    del layer, call, built
    return fwd, train, peak, train_fresh, peak_fresh


def peak_mb(step, base: int, params: int) -> float:
    """MB allocated at most during step() above `base`, less the weights and their gradients
    (`params` bytes each)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base - 2 * params) / 2**20


def main(argv=None):
    ap = argparse.ArgumentParser(prog="benchmarks/peers_sonicmoe.py",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=10, help="timed calls a measurement")
    ap.add_argument("--out", default=result_file.RESULTS,
                    help="folder of peers_sonicmoe.json (default: %(default)s)")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES),
                    help="comma-separated names from SHAPES")
    ap.add_argument("--dtypes", default="bf16",
                    help="mokgen's precisions, comma-separated: bf16 and/or fp8 (default: "
                         "%(default)s); fp8 fills the mokgen_fp8_* columns")
    ap.add_argument("--prebuild", action="store_true",
                    help="only compile mokgen's kernels for the shapes (no GPU needed)")
    ap.add_argument("--sustained", type=float, default=0.0, metavar="S",
                    help="also time the forward and the training step back to back for S "
                         "seconds each, at the power cap (mokgen with fused accumulation, "
                         "its default in one process, and SonicMoE): the *_sustained_* columns")
    a = ap.parse_args(argv)
    wanted = a.shapes.split(",")
    unknown = set(wanted) - {s[0] for s in SHAPES}
    if unknown:
        ap.error(f"unknown shapes {sorted(unknown)}; known: {[s[0] for s in SHAPES]}")
    dtypes = a.dtypes.split(",")
    if not dtypes or set(dtypes) - {"bf16", "fp8"}:
        ap.error(f"--dtypes takes bf16 and/or fp8, got {a.dtypes!r}")
    if a.prebuild:
        prebuild([s for s in SHAPES if s[0] in wanted], dtypes)
        return 0
    rows = []
    for name, T, D, I, E, k in (s for s in SHAPES if s[0] in wanted):
        flops = 6 * T * k * D * I
        # steps_change_weights: each step re-derives what a layer caches from its weights
        row = dict(shape=name, T=T, D=D, I=I, E=E, k=k, steps_change_weights=True)
        if a.sustained > 0:
            row["sustained_s"] = a.sustained
        for dt in dtypes:
            row.update(mokgen_columns(name, (D, I, E, k, T), dt, flops, a.iters, a.sustained))
        print(f"{name}: SonicMoE", flush=True)
        xs = {}
        s = measure(lambda: sonicmoe_layer(D, I, E, k), T, D, a.iters, a.sustained, xs)
        row.update(sonicmoe_fwd_tflops=tflops(s[0], flops),
                   sonicmoe_train_tflops=tflops(s[1], 3 * flops), sonicmoe_peak_mb=s[2],
                   sonicmoe_train_fresh_tflops=tflops(s[3], 3 * flops),
                   sonicmoe_peak_fresh_mb=s[4])
        if a.sustained > 0:
            row.update(sonicmoe_fwd_sustained_tflops=tflops(xs.get("fwd_sustained_ms"), flops),
                       sonicmoe_train_sustained_tflops=tflops(xs.get("train_sustained_ms"),
                                                              3 * flops))
        rows.append(row)
        print(json.dumps(row), flush=True)
        write(a.out, rows)


def tflops(ms, flops):
    return None if ms is None else flops / ms / 1e9


def mokgen_columns(name, dims, dtype, flops, iters, sustained) -> dict:
    """mokgen's columns of a row in one precision (bf16: `mokgen_*`, fp8: `mokgen_fp8_*`):
    the layer with autograd adding the expert gradients, then with fused accumulation."""
    D, I, E, k, T = dims
    p = "mokgen" if dtype == "bf16" else f"mokgen_{dtype}"
    print(f"{name}: {p}", flush=True)
    m = measure(lambda: mokgen_layer(D, I, E, k, T, dtype=dtype), T, D, iters)
    print(f"{name}: {p} fused", flush=True)
    xm = {}
    mf = measure(lambda: mokgen_layer(D, I, E, k, T, fuse=True, dtype=dtype), T, D, iters,
                 sustained, xm)
    cols = {f"{p}_fwd_tflops": tflops(m[0], flops), f"{p}_train_tflops": tflops(m[1], 3 * flops),
            f"{p}_peak_mb": m[2], f"{p}_fused_train_tflops": tflops(mf[1], 3 * flops),
            f"{p}_fused_peak_mb": mf[2], f"{p}_train_fresh_tflops": tflops(m[3], 3 * flops),
            f"{p}_peak_fresh_mb": m[4]}
    if sustained > 0:
        cols[f"{p}_fwd_sustained_tflops"] = tflops(xm.get("fwd_sustained_ms"), flops)
        cols[f"{p}_fused_train_sustained_tflops"] = tflops(xm.get("train_sustained_ms"),
                                                            3 * flops)
    return cols


def write(out: str, rows: list) -> None:
    """This run's rows into OUT/peers_sonicmoe.json and its plot; a table."""
    from mokgen.harness.plot import plot_peers

    result_file.write("peers_sonicmoe", rows, ("shape", "T"), out=out, plot=plot_peers)
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    print("| shape | fwd mokgen | SonicMoE | train mokgen / fused | SonicMoE "
          "| peak MB mokgen / fused | SonicMoE | train fresh mokgen | SonicMoE "
          "| peak fresh MB mokgen | SonicMoE |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {fmt(r['mokgen_fwd_tflops'])} | {fmt(r['sonicmoe_fwd_tflops'])} "
              f"| {fmt(r['mokgen_train_tflops'])} / {fmt(r.get('mokgen_fused_train_tflops'))} "
              f"| {fmt(r['sonicmoe_train_tflops'])} "
              f"| {fmt(r['mokgen_peak_mb'])} / {fmt(r.get('mokgen_fused_peak_mb'))} "
              f"| {fmt(r['sonicmoe_peak_mb'])} "
              f"| {fmt(r.get('mokgen_train_fresh_tflops'))} "
              f"| {fmt(r.get('sonicmoe_train_fresh_tflops'))} "
              f"| {fmt(r.get('mokgen_peak_fresh_mb'))} | {fmt(r.get('sonicmoe_peak_fresh_mb'))} |")
    if any("mokgen_fp8_train_tflops" in r for r in rows):
        print("\nmokgen fp8 against SonicMoE bf16, TFLOP/s and MB:")
        print("| shape | fwd fp8 | train fp8 / fused | SonicMoE train | x | peak fp8 fused / "
              "fresh | SonicMoE peak / fresh |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            x8, xs = r.get("mokgen_fp8_train_tflops"), r.get("sonicmoe_train_tflops")
            print(f"| {r['shape']} | {fmt(r.get('mokgen_fp8_fwd_tflops'))} "
                  f"| {fmt(x8)} / {fmt(r.get('mokgen_fp8_fused_train_tflops'))} | {fmt(xs)} "
                  f"| {'-' if not (x8 and xs) else f'{x8 / xs:.2f}'} "
                  f"| {fmt(r.get('mokgen_fp8_fused_peak_mb'))} / "
                  f"{fmt(r.get('mokgen_fp8_peak_fresh_mb'))} "
                  f"| {fmt(r.get('sonicmoe_peak_mb'))} / {fmt(r.get('sonicmoe_peak_fresh_mb'))} |")
    if any("sustained_s" in r for r in rows):
        print("\nback to back at the power cap (sustained), TFLOP/s:")
        print("| shape | fwd mokgen | SonicMoE | train mokgen fused | SonicMoE |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['shape']} | {fmt(r.get('mokgen_fwd_sustained_tflops'))} "
                  f"| {fmt(r.get('sonicmoe_fwd_sustained_tflops'))} "
                  f"| {fmt(r.get('mokgen_fused_train_sustained_tflops'))} "
                  f"| {fmt(r.get('sonicmoe_train_sustained_tflops'))} |")


if __name__ == "__main__":
    main()
