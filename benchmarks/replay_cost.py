"""What a model pays for the shared ring: L layers of one shape share one workspace
(runtime/workspace.py's pool), so only the backward of the layer whose forward ran last finds
its activations in the ring; every other layer's backward replays its gate/up (re-pulls x,
recomputes h and a: moe_bwd.cuh `replayed`), unless the plan has keep_h (each call keeps
its own h; the backward pulls x: the default at one rank in bf16, passes/keep_h.py). The
variant `sonicmoe` stacks SonicMoE's layers instead (each keeps its own h; run where it is
installed: benchmarks/peers_sonicmoe.sh stack). This
times a training step of L independent layers on the same x (outputs summed into one backward:
autograd runs the layers' backwards last layer first) against one layer, per layer, fresh
gradients (zero_grad(set_to_none)).

    python3 benchmarks/replay_cost.py --out $OUT [--shapes qwen3-30b-a3b,...] [--layers 1,4]
        [--variants NAME+field=value,...] [--prebuild]

Prints per shape the per-layer step ms at each L, the ratio to L = 1, the backward calls
that replayed (the runtimes' counts) and memory: the step's peak above what was allocated
before it, the same above what was allocated before the layers were built (weights and their
gradients out: peers_sonicmoe.py's peak, workspace included), what the forwards keep per
layer, the workspace measured and mokgen's own report of it and of the bytes saved per call
(`layer.memory()`), and per layer the GPU's time alone (the step's launches queued ahead),
the sum of its kernels' durations (mokgen's own among them) and the time some kernel ran
(kernel_split): event time less the GPU's alone is the host's share, and the GPU's alone
less the busy time is the GPU's own idle; writes OUT/replay_cost.json. keep_h's memory
against the default's: `--shapes qwen3-30b-a3b --layers 1,2` (what
benchmarks/memprobe_keep_h.py measured).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import mokgen  # noqa: E402
from mokgen.harness.bench import (QUEUE_AHEAD_CYCLES, kernel_times, results_commit,  # noqa: E402
                          short_kernel_name, time_ms)
from gather_ab import prebuild, selected, selection_args  # noqa: E402
from peers_sonicmoe import sonicmoe_layer  # noqa: E402

SONICMOE = {}  # the variant `sonicmoe`, told apart by identity


def runtimes():
    from mokgen.runtime.moe import ForwardRuntime
    return [o for o in gc.get_objects() if isinstance(o, ForwardRuntime)]


def make_layer(D, I, E, k, T, over):
    """-> (module, its call): mokgen.MoE with the variant's overrides, or SonicMoE's layer for
    the variant `sonicmoe` (peers_sonicmoe.sonicmoe_layer; None where it does not import)."""
    if over is SONICMOE:
        return sonicmoe_layer(D, I, E, k)
    # .to(bf16) as SonicMoE's layer (its router included): an fp32 router would keep an fp32
    # copy of x per layer for its weight gradient
    m = mokgen.MoE(mokgen.MoEShape(E, D, I, k, shared_experts=0), tokens_per_rank=T,
                   **over, device="cuda").to(torch.bfloat16)
    return m, m


def measure(D, I, E, k, T, L, iters, over, table_n=0):
    gc.collect()
    torch.cuda.empty_cache()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    torch.cuda.synchronize()
    base0 = torch.cuda.memory_allocated()  # before the layers: x and dy only
    built = [make_layer(D, I, E, k, T, over) for _ in range(L)]
    if None in built:
        return None
    layers, calls = [b[0] for b in built], [b[1] for b in built]
    params = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())

    def fresh():
        for m in layers:
            m.zero_grad(set_to_none=True)

    def step(mark=None):
        xg = x.detach().requires_grad_()
        outs = [c(xg) for c in calls]
        if mark is not None:  # what the forwards keep for the backward
            torch.cuda.synchronize()
            mark.append(torch.cuda.memory_allocated())
        torch.autograd.backward(outs, [dy] * L)

    t0 = time.perf_counter()
    step()  # SonicMoE JIT-compiles its kernels here (minutes, once per shape and process)
    torch.cuda.synchronize()
    print(f"  L {L}: first step in {time.perf_counter() - t0:.0f} s", flush=True)
    before = sum(r.stats["replayed"] for r in runtimes())
    bwd_before = sum(r.stats["backward"] for r in runtimes())
    ms = time_ms(step, iters, warmup=3, setup=fresh)
    replayed = sum(r.stats["replayed"] for r in runtimes()) - before
    bwd_calls = sum(r.stats["backward"] for r in runtimes()) - bwd_before
    # the GPU's time alone: the step's launches queued behind a sleep longer than its host
    # work (~5 ms a layer eager: (L + 1) x ~10 ms), so no launch gap is left in it
    gpu_ms = time_ms(step, iters, warmup=1, setup=fresh, queue_ahead=True,
                     sleep_cycles=(L + 1) * QUEUE_AHEAD_CYCLES)
    t1 = time.perf_counter()
    kernels = kernel_times(fresh, step)  # one step's kernels: (name, start us, duration us)
    t2 = time.perf_counter()
    fresh()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    mark = []
    step(mark)
    torch.cuda.synchronize()
    top = torch.cuda.max_memory_allocated()
    # mokgen's own report (CompiledMoE.memory), beside what was measured
    rep = layers[0].memory() if isinstance(layers[0], mokgen.MoE) else {}
    # where a measurement's wall time goes (a two-variant row at L 1, 4 took ~6 min)
    print(f"  L {L}: timed in {t1 - t0:.0f} s, profiled in {t2 - t1:.0f} s, whole "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    del layers, calls, built
    table = kernel_table(kernels, L, table_n)  # --kernel-table
    for name, kms, c in table:
        print(f"    {kms:7.3f} ms/layer {c:5.1f}x  {name}", flush=True)
    sequence = kernel_sequence(kernels) if table_n and L == 1 else []
    for name, t, d in sequence:
        print(f"    at {t:9.1f} us {d:8.1f} us  {name}", flush=True)
    return dict(ms_per_layer=ms / L, replayed_per_step=replayed / max(1, bwd_calls) * L,
                **kernel_split(kernels, gpu_ms, L), kernel_table=table,
                kernel_sequence=sequence,
                # above the memory before the step (workspace in it), its gradients out
                peak_mb=(top - base - params) / 2**20,
                # above the memory before the layers were built, weights and gradients out:
                # peers_sonicmoe.py's peak (workspace included)
                total_peak_mb=(top - base0 - 2 * params) / 2**20,
                workspace_mb=(base - base0 - params) / 2**20,  # what stays between steps
                kept_mb_per_layer=(mark[0] - base) / L / 2**20,
                reported_workspace_mb=rep.get("workspace", 0) / 2**20,
                reported_saved_per_call_mb=rep.get("saved_per_call", 0) / 2**20)


def kernel_table(kernels: list, L: int, n: int) -> list:
    """The step's kernels grouped by name, per layer: [short name, ms, launches], the n
    largest by time first. It says which kernels a peer runs faster, beyond the totals of
    kernel_split."""
    by = {}
    for name, _, d in kernels:
        e = by.setdefault(name, [0.0, 0])
        e[0] += d
        e[1] += 1
    top = sorted(by.items(), key=lambda kv: -kv[1][0])[:n]
    return [[short_kernel_name(name), us / 1e3 / L, c / L] for name, (us, c) in top]


def kernel_sequence(kernels: list, min_us: float = 20.0) -> list:
    """The step's kernels of at least min_us in launch order: [short name, start us, us]. At
    L 1 it maps each of a peer's GEMM launches to the layer's forward or backward GEMM."""
    return [[short_kernel_name(name), t, d] for name, t, d in kernels if d >= min_us]


def kernel_split(kernels: list, gpu_ms: float, L: int) -> dict:
    """Where a step's GPU time goes, per layer: the GPU's time alone (launches queued ahead),
    the sum of its kernels' durations from the profiler, mokgen's own kernels among them
    (`mokgen_*`) and the time some kernel ran (the union of their intervals; below the sum
    where kernels overlap). Event time minus the GPU's alone is the host's share: launch
    gaps a model's other layers may or may not hide."""
    busy, end = 0.0, float("-inf")
    for _, t, d in sorted(kernels, key=lambda k: k[1]):
        busy += max(0.0, t + d - max(t, end))
        end = max(end, t + d)
    per = lambda us: us / 1e3 / L  # noqa: E731
    return dict(gpu_ms_per_layer=gpu_ms / L,
                kernels_ms_per_layer=per(sum(d for _, _, d in kernels)),
                mokgen_kernels_ms_per_layer=per(sum(d for n, _, d in kernels
                                                    if n.startswith("mokgen"))),
                busy_ms_per_layer=per(busy))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--layers", default="1,4")
    ap.add_argument("--kernel-table", type=int, default=0, metavar="N",
                    help="print each measurement's N longest kernels (per layer, by name) and, "
                    "at L 1, its kernels of 20 us or more in launch order")
    selection_args(ap, "pull+keep_h=false,pull",
                   "gather_ab.py's variants (pull: the default plan, keep_h at one rank in "
                   "bf16: each call keeps its h, no backward replays; +keep_h=false: h in the "
                   "shared ring, replayed) and sonicmoe (SonicMoE's layers, where it imports)")
    a = ap.parse_args(argv)
    peer = "sonicmoe" in a.variants.split(",")
    a.variants = ",".join(v for v in a.variants.split(",") if v != "sonicmoe")
    shapes, variants = selected(a)
    if a.prebuild:
        prebuild(shapes, variants)
        return 0
    if peer:
        variants["sonicmoe"] = SONICMOE
    rows = []
    Ls = [int(v) for v in a.layers.split(",")]
    for name, T, D, I, E, k in shapes:
        for vname, over in variants.items():
            r = dict(shape=name, T=T, variant=vname)
            for L in Ls + Ls[::-1]:  # mirrored: each L twice, medians of the two
                m = measure(D, I, E, k, T, L, a.iters, over, a.kernel_table)
                if m is None:
                    break
                r.setdefault(L, []).append(m)
            if m is None:
                print(f"{name} | {vname}: not importable, skipped", flush=True)
                continue
            for L in Ls:
                ms = sorted(x["ms_per_layer"] for x in r[L])
                r[f"L{L}_ms_per_layer"] = sum(ms) / len(ms)
                for key in ("replayed", "peak_mb", "total_peak_mb", "workspace_mb",
                            "kept_mb_per_layer", "reported_workspace_mb",
                            "reported_saved_per_call_mb"):
                    r[f"L{L}_{key}"] = r[L][0]["replayed_per_step" if key == "replayed" else key]
                for key in ("gpu_ms_per_layer", "kernels_ms_per_layer",
                            "mokgen_kernels_ms_per_layer", "busy_ms_per_layer"):
                    r[f"L{L}_{key}"] = sum(x[key] for x in r[L]) / len(r[L])
                r[f"L{L}_kernel_table"] = r[L][0]["kernel_table"]
                r[f"L{L}_kernel_sequence"] = r[L][0]["kernel_sequence"]
                del r[L]
            base = r[f"L{Ls[0]}_ms_per_layer"]
            flops = 18 * T * k * D * I
            print(" | ".join([name, vname] + [
                f"L{L} {r[f'L{L}_ms_per_layer']:.3f} ms/layer "
                f"({flops / r[f'L{L}_ms_per_layer'] / 1e9:.0f} TFLOP/s, "
                f"x{r[f'L{L}_ms_per_layer'] / base:.3f}, replayed {r[f'L{L}_replayed']:.0f}, "
                f"GPU alone {r[f'L{L}_gpu_ms_per_layer']:.3f}, kernels "
                f"{r[f'L{L}_kernels_ms_per_layer']:.3f} (mokgen "
                f"{r[f'L{L}_mokgen_kernels_ms_per_layer']:.3f}), busy "
                f"{r[f'L{L}_busy_ms_per_layer']:.3f} ms/layer, "
                f"peak {r[f'L{L}_peak_mb']:.0f} MB, total peak "
                f"{r[f'L{L}_total_peak_mb']:.0f} MB, kept {r[f'L{L}_kept_mb_per_layer']:.0f} "
                f"MB/layer, workspace {r[f'L{L}_workspace_mb']:.0f} MB, reported "
                f"{r[f'L{L}_reported_workspace_mb']:.0f} / saved per call "
                f"{r[f'L{L}_reported_saved_per_call_mb']:.0f})" for L in Ls]), flush=True)
            rows.append(r)
            write(a.out, rows)  # after each row: a call cut short keeps what it measured
    return 0


def write(out: str, rows: list) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "replay_cost.json"), "w") as f:
        json.dump(dict(commit=results_commit(), gpu=torch.cuda.get_device_name(), rows=rows),
                  f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
