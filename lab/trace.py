"""Where a megakernel's time goes, task by task: the slice's forward and backward built with
the `trace` profile (runtime/include/mokgen/trace.cuh: per-task clocks, results unchanged),
run once each after warm-up, and summed per task kind and over time.

Per task: ask -> got is the producer's wait for the task: with a scheduling thread
(GemmCfg::SCHEDULER, bf16) what of the scheduler's next_task (the atomic, the decode and the
dependency waits) did not finish under the previous task's slices; else its own next_task;
pop -> main the consumers' mainloop (TMA data waits included), main -> epi the epilogue,
epi -> done the consumers' barrier and the signal; a consumer's idle time is the gap between
one task's done and the next one's pop, charged to the task it waited for. Cooperative
consumers only (the default, -sw and -solo, whose solo tasks the warpgroup that runs them
records; two warpgroups' solo tasks overlap in time, so their idle, taken in channel order,
can read negative): ping-pong builds record the producer's side alone, which this summary
skips.
Usage: python lab/trace.py SHAPE EP N [DTYPE] [--gemm 128x256x4] [--gemm-bwd
       128x256x4-solo] [--out DIR]
       [--also PROFILE,...] (more profiles beside `trace`, e.g. no_dgrad_loads: what a part
       of an epilogue costs; those builds' results are wrong by design)
       [--plan KEY=VALUE ...] (plan overrides, e.g. dispatch=gather; in the file's name)
       [--prebuild] (compile only, here; then carry MOKGEN_CACHE: lab/ab_trace.sh)
       [--clocks] (then the SM clock and the board power, from nvidia-smi every 20 ms, while
       the forward runs back to back for a second, then forward + backward: whether a
       direction runs against the power limit, which the per-task clocks cannot tell)
Prints, per kernel: the SM time per task kind (mainloop / epilogue / signal / idle, ms summed
over CTAs), each kind's mean mainloop TFLOP/s per SM scaled to the GPU, the share of
CTAs in a mainloop in 20 time bins, and the start (when the CTAs' first mainloops begin,
their first tasks' kinds and dependency waits); then each direction's GPU kernels from torch.profiler
(what the event time holds besides the traced tasks); writes
trace_<shape>_ep<EP>_n<N>_<dtype>[_<also profile>...][_<key>-<value>...].json under --out."""
import argparse
import collections
import datetime
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import mokgen  # noqa: E402
from mokgen.harness.bench import (kernel_times, make_slice, short_kernel_name, sustained_ms,  # noqa: E402
                          time_ms)
from mokgen.cli import _gemm  # noqa: E402
from mokgen.harness.trace import traced  # noqa: E402
from mokgen.runtime import abi  # noqa: E402

F = {k: i for i, k in enumerate(abi.TRACE_FIELDS)}
BINS = 20


def overrides(pairs: list) -> dict:
    """--plan KEY=VALUE pairs -> plan overrides (integers as ints)."""
    out = {}
    for p in pairs:
        key, _, value = p.partition("=")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out




def summarize(recs, ops, bm, bn):
    """Per task kind and over time; durations in ms (SM clocks scaled by each CTA's
    globaltimer / clock64 ratio)."""
    names = {v: k[1:] for k, v in ops.items()}  # kDgrad -> Dgrad
    op_, ask, got, pop, main, epi, done, gns, fill_w, fill_i, full_w = (
        F[k] for k in abi.TRACE_FIELDS)
    kinds, spans, firsts, mhz = {}, [], [], []
    t_lo = t_hi = None
    for cta in recs:
        r = [row for row in cta if row[got] != 0 and row[done] != 0]  # both sides recorded
        if len(r) < 2:
            continue
        ns_per_clk = (r[-1][gns] - r[0][gns]) / max(1, r[-1][pop] - r[0][pop])
        ms = ns_per_clk / 1e6
        if ns_per_clk > 0:
            mhz.append(1e3 / ns_per_clk)  # this CTA's SM clock over its tasks
        prev_done = r[0][ask]
        t0 = r[0][gns] - (r[0][pop] - r[0][ask]) * ns_per_clk
        t_lo = t0 if t_lo is None else min(t_lo, t0)
        # the CTA's first task: its kind, when its mainloop began (global ns) and how long
        # the producer waited for it (next_task: the dependency waits)
        firsts.append((names.get(r[0][op_] & abi.OPCODE_MASK, "?"), r[0][gns],
                       (r[0][got] - r[0][ask]) * ns_per_clk))
        for row in r:
            op, kb = row[op_] & 0xffffffff, row[op_] >> 32
            code = op & abi.OPCODE_MASK
            d = kinds.setdefault(names.get(code, str(code)),
                                 dict(tasks=0, k_blocks=0, idle_ms=0.0, mainloop_ms=0.0,
                                      epilogue_ms=0.0, signal_ms=0.0, ask_ms=0.0, flops=0.0,
                                      mainloop_clk=0, fill_wait_ms=0.0, fill_issue_ms=0.0,
                                      full_wait_ms=0.0))
            d["tasks"] += 1
            d["k_blocks"] += kb
            d["idle_ms"] += (row[pop] - prev_done) * ms
            d["mainloop_ms"] += (row[main] - row[pop]) * ms
            d["mainloop_clk"] += row[main] - row[pop]  # SM clocks: a rate the clock leaves alone
            d["epilogue_ms"] += (row[epi] - row[main]) * ms
            d["signal_ms"] += (row[done] - row[epi]) * ms
            d["ask_ms"] += (row[got] - row[ask]) * ms
            # the ring's side (clock sums over the task's slices, trace.cuh): the producer
            # waiting for empty stages and issuing, the consumers waiting for full ones
            d["fill_wait_ms"] += row[fill_w] * ms
            d["fill_issue_ms"] += row[fill_i] * ms
            d["full_wait_ms"] += row[full_w] * ms
            bk = 128 if op & abi.F8_TASK else 64  # fp8 tiles count K blocks of 128
            n = bn // 2 if op & (abi.HALF_N_TASK) else bn  # narrow
            d["flops"] += 2.0 * bm * n * bk * kb
            prev_done = row[done]
            g = row[gns]  # the pop's global ns; the phases after it by this CTA's ratio
            spans.append((g, g + (row[main] - row[pop]) * ns_per_clk,
                          g + (row[done] - row[pop]) * ns_per_clk))
        t_hi = spans[-1][2] if t_hi is None else max(t_hi, spans[-1][2])
    ctas = len(recs)
    out = dict(ctas=ctas, span_ms=(t_hi - t_lo) / 1e6 if spans else 0.0, kinds={},
               sm_mhz=sorted(mhz)[len(mhz) // 2] if mhz else 0.0)
    for k, d in kinds.items():
        d["mean_k_blocks"] = d.pop("k_blocks") / d["tasks"]
        # the mainloop's rate, as if every CTA ran this kind's tiles at it
        d["mainloop_tflops_gpu"] = d["flops"] * ctas / (d["mainloop_ms"] * 1e9) \
            if d["mainloop_ms"] else 0.0
        # FLOP a clock an SM in the mainloop (H100 / H200 dense bf16 peak: 4,096), what two
        # traces compare when their clocks differ (the power cap moves them run to run)
        d["mainloop_flop_per_clk"] = d["flops"] / d["mainloop_clk"] if d["mainloop_clk"] else 0.0
        d["mean_epilogue_us"] = 1e3 * d["epilogue_ms"] / d["tasks"]
        d["mean_mainloop_us"] = 1e3 * d["mainloop_ms"] / d["tasks"]
        d["mean_ask_us"] = 1e3 * d["ask_ms"] / d["tasks"]  # the producer's next_task
        for w in ("fill_wait", "fill_issue", "full_wait"):
            d[f"mean_{w}_us"] = 1e3 * d[f"{w}_ms"] / d["tasks"]
        out["kinds"][k] = d
    if spans:  # share of the CTAs inside a mainloop / an epilogue + signal, per time bin
        w = (t_hi - t_lo) / BINS
        main_b, epi_b = [0.0] * BINS, [0.0] * BINS
        for p, m, e in spans:
            for acc, a, b in ((main_b, p, m), (epi_b, m, e)):
                for i in range(max(0, int((a - t_lo) // w)), min(BINS, int((b - t_lo) // w) + 1)):
                    lo, hi = max(a, t_lo + i * w), min(b, t_lo + (i + 1) * w)
                    acc[i] += max(0.0, hi - lo)
        out["bins_mainloop"] = [round(v / (w * ctas), 3) for v in main_b]
        out["bins_epilogue"] = [round(v / (w * ctas), 3) for v in epi_b]
    if firsts:  # the start: how long the CTAs take to their first mainloop, and why
        starts = sorted((g - t_lo) / 1e3 for _, g, _ in firsts)
        waits = sorted(w / 1e3 for _, _, w in firsts)
        out["start"] = dict(first_main_us_median=starts[len(starts) // 2],
                            first_main_us_max=starts[-1],
                            first_wait_us_median=waits[len(waits) // 2],
                            first_kinds=dict(collections.Counter(k for k, _, _ in firsts)))
    return out


def clocks(phases, seconds=1.0):
    """Median SM clock (MHz), board power and its enforced limit (W), and the share of
    samples under the software power cap (nvidia-smi's throttle reasons, bit 0x4) while each
    phase's callable runs back to back for `seconds`, and its sustained time a call there
    (ms: calls after the first 0.2 s over their span, the clock having settled under the cap;
    short timing loops can end before the power limit bites): {name: dict(mhz, watts,
    limit_w, power_capped, samples, ms)}."""
    q = "timestamp,clocks.sm,power.draw,enforced.power.limit,clocks_throttle_reasons.active"
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits",
                            "-lms", "20", "-i", str(torch.cuda.current_device())],
                           stdout=subprocess.PIPE, text=True)
    spans, sustained, settle = {}, {}, 0.2  # the first 0.2 s of a phase: the clocks settle
    try:
        time.sleep(0.3)
        for name, fn in phases:
            t0 = time.time()
            sustained[name] = sustained_ms(fn, seconds, settle=settle)
            spans[name] = (t0 + settle, time.time())
    finally:
        smi.terminate()
    out = {}
    rows = []
    for line in smi.communicate()[0].splitlines():
        f = [v.strip() for v in line.split(",")]
        try:
            t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((t, float(f[1]), float(f[2]), float(f[3]),
                         bool(int(f[4], 16) & 0x4)))  # the software power cap's bit
        except (ValueError, IndexError):
            continue
    for name, (a, b) in spans.items():
        r = [x for x in rows if a <= x[0] <= b]
        if r:
            med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
            out[name] = dict(mhz=med([x[1] for x in r]), watts=med([x[2] for x in r]),
                             limit_w=med([x[3] for x in r]),
                             power_capped=sum(x[4] for x in r) / len(r), samples=len(r))
        out.setdefault(name, {})["ms"] = sustained[name]
    return out


def table(title, s):
    lines = [f"### {title}: {s['ctas']} CTAs, span {s['span_ms']:.3f} ms (SM-ms summed over CTAs), "
             f"SM clock {s.get('sm_mhz', 0):.0f} MHz (median CTA: clock64 / globaltimer)",
             "| kind | tasks | K blk | mainloop | epilogue | signal | idle | main us | epi us | "
             "main TFLOP/s | ask us | main FLOP/clk | fill wait us | fill issue us | "
             "full wait us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    tot = dict(mainloop_ms=0, epilogue_ms=0, signal_ms=0, idle_ms=0)
    for k, d in sorted(s["kinds"].items(), key=lambda kv: -kv[1]["mainloop_ms"]):
        for key in tot:
            tot[key] += d[key]
        lines.append(f"| {k} | {d['tasks']} | {d['mean_k_blocks']:.0f} | {d['mainloop_ms']:.1f} "
                     f"| {d['epilogue_ms']:.1f} | {d['signal_ms']:.1f} | {d['idle_ms']:.1f} | "
                     f"{d['mean_mainloop_us']:.1f} | {d['mean_epilogue_us']:.1f} | "
                     f"{d['mainloop_tflops_gpu']:.0f} | {d['mean_ask_us']:.2f} | "
                     f"{d['mainloop_flop_per_clk']:.0f} | {d['mean_fill_wait_us']:.2f} | "
                     f"{d['mean_fill_issue_us']:.2f} | {d['mean_full_wait_us']:.2f} |")
    all_ms = sum(tot.values()) or 1.0
    lines.append("| all (share) | | | " + " | ".join(
        f"{tot[k]:.1f} ({100 * tot[k] / all_ms:.0f}%)" for k in tot) + " | | | | | | | | |")
    if "bins_mainloop" in s:
        lines.append("mainloop share per bin: " + " ".join(f"{v:.2f}" for v in s["bins_mainloop"]))
        lines.append("epilogue share per bin: " + " ".join(f"{v:.2f}" for v in s["bins_epilogue"]))
    if "start" in s:
        st = s["start"]
        lines.append(f"start: first mainloop at {st['first_main_us_median']:.1f} us (median CTA; "
                     f"last {st['first_main_us_max']:.1f}), its task's dependency wait "
                     f"{st['first_wait_us_median']:.1f} us; first tasks " + ", ".join(
                         f"{k} x{v}" for k, v in sorted(st["first_kinds"].items())))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape")
    ap.add_argument("ep", type=int)
    ap.add_argument("n", type=int)
    ap.add_argument("dtype", nargs="?", default="bf16")
    ap.add_argument("--gemm", type=_gemm, default=None, metavar="BMxBNxSTAGES[-pp|-sw]")
    ap.add_argument("--gemm-bwd", type=_gemm, default=None, metavar="BMxBNxSTAGES[-...|-solo]",
                    help="the backward's alone (after --gemm)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--also", default="", metavar="PROFILE[,PROFILE]",
                    help="more profiles (runtime/abi.py PROFILES), e.g. no_dgrad_loads")
    ap.add_argument("--prebuild", action="store_true",
                    help="only compile the traced kernels into MOKGEN_CACHE (no GPU needed)")
    ap.add_argument("--plan", nargs="*", default=[], metavar="KEY=VALUE",
                    help="plan overrides, e.g. dispatch=gather")
    ap.add_argument("--clocks", action="store_true",
                    help="also the SM clock and power while each direction runs (nvidia-smi)")
    a = ap.parse_args()
    also = tuple(p for p in a.also.split(",") if p)
    prof = ("trace",) + also
    over = overrides(a.plan)
    suffix = "".join("_" + p for p in also) + "".join(f"_{k}-{v}" for k, v in over.items())
    gemm = dict(gemm_fwd=a.gemm, gemm_bwd=a.gemm) if a.gemm else {}
    if a.gemm_bwd:
        gemm["gemm_bwd"] = a.gemm_bwd
    shape, ep, n = mokgen.shapes.get(a.shape), a.ep, a.n
    if a.prebuild:
        from mokgen.pytorch.api import build_plans
        from mokgen.compiler.tuned import tuned_plan

        plan = tuned_plan(shape, ep, a.dtype, n, profile=prof, **gemm, **over)
        bins = build_plans([plan])
        print(f"{a.shape} ep {ep} N {n} {a.dtype}: {len(bins)} kernels, spills "
              f"{sum(r['spill_stores'] for b in bins for r in b.resources.values())} B, "
              f"wgmma serialized in {[b.name for b in bins if b.serialized]}")
        return
    g = torch.Generator(device="cuda").manual_seed(0)
    xs, zs, w1, w2, sw1, sw2 = make_slice(shape, ep, n, g)
    layer = mokgen.compile(shape, ep=ep, tokens_per_rank=n, virtual=True, dtype=a.dtype,
                           profile=prof, **gemm, **over)
    rt, bwd = layer.runtime(), layer.backward_runtime()
    w1s, w2s = [w1] * ep, [w2] * ep
    layer(x=xs, router_logits=zs, w1=w1s, w2=w2s, shared_w1=sw1, shared_w2=sw2)
    dys = [torch.randn(x.shape, device="cuda", generator=g).bfloat16() for x in xs]
    fwd = lambda: rt.forward_rank(0, xs, zs, w1s, w2s, sw1, sw2, save=True)  # noqa: E731
    back = lambda: bwd.backward_rank(0, dys, xs, w1s, w2s, sw1, sw2)  # noqa: E731
    res = dict(shape=a.shape, ep=ep, n=n, dtype=a.dtype, commit=os.environ.get("MOKGEN_COMMIT"),
               plan_overrides=over, gemm=str(a.gemm or "default"),
               gemm_bwd=str(a.gemm_bwd or a.gemm or "default"),
               fwd_ms=time_ms(fwd, 20),
               bwd_ms=time_ms(back, 20, setup=fwd))
    plan = layer.plan
    res["fwd"] = summarize(traced(rt.fwd_module, rt.fwd_ctas, fwd), abi.FWD_OPS, 128,
                           plan.gemm_fwd.bn)
    fwd()
    res["bwd"] = summarize(traced(bwd.modules, bwd.ctas, back), abi.BWD_OPS, 128,
                           plan.gemm_bwd.bn)
    res["fwd_kernels"] = kernel_times(lambda: None, fwd)
    res["bwd_kernels"] = kernel_times(fwd, back)
    if a.clocks:
        res["clocks"] = clocks([("forward", fwd), ("forward+backward", lambda: (fwd(), back()))])
    os.makedirs(a.out, exist_ok=True)
    name = f"trace_{a.shape}_ep{ep}_n{n}_{a.dtype}{suffix}.json"
    with open(os.path.join(a.out, name), "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"{a.shape} ep {ep} N {n} {a.dtype}: forward {res['fwd_ms']:.3f} ms, backward "
          f"{res['bwd_ms']:.3f} ms (event-timed, traced builds)")
    print(table("forward", res["fwd"]))
    print(table("backward", res["bwd"]))
    for k, c in res.get("clocks", {}).items():
        print(f"clocks, {k} back to back: SM {c['mhz']:.0f} MHz, {c['watts']:.0f} W (limit "
              f"{c['limit_w']:.0f}), power-capped in {100 * c['power_capped']:.0f}% of "
              f"{c['samples']} samples")
    for d in ("fwd", "bwd"):  # name @ start us: duration us
        print(f"{d} kernels:", ", ".join(f"{short_kernel_name(n)} @{t0}: {dt}"
                                        for n, t0, dt in res[f"{d}_kernels"]))


if __name__ == "__main__":
    main()
