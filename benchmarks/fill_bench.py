"""How fast one SM fills a ring of shared-memory stages with token rows, outside the
megakernel (benchmarks/fill_bench.cu; benchmarks/NOTES.md, sessions 13 and 14). Every CTA
streams slices of 64 rows through `stages` stages and one consumer thread frees each
(optionally after `hold` clocks; a 128 x 256 x 64 slice's MMA at the tensor peak is 1,024).
Fill mechanisms (`mode`, fill_bench.cu's header has them all): cp.async as the megakernel
(5: tokens read once a slice and shuffled; 0: a table load before each copy), with commit
groups (1), or waited for before arriving (11); registers (6, 8); TMA of rows in order (2) or
a box a row (9); cp.async beside a 16 KB TMA operand (4, 12); and fill_pair (10, 13): two
CTAs of a cluster each gathering half the rows and sending that half to the other's stage
by a DSMEM bulk copy. Sweeps: producer warps, ring depth, 256- or 512-byte rows, hold,
CTAs (66: whether a rate is the SM's or a share of the L2's), the wait instruction, and
`--tokens` (rows from a small, L2-resident set). Bytes per clock count the gathered rows;
"issue / empty-wait clk" are the producer thread 0's clocks a slice.

Checks: CTA 0's last slice, copied out by the consumer into a poisoned buffer, holds the
source rows it names, bytes where TMA's 128B swizzle puts them (host-side expected layout);
exits 1 if any variant's are wrong. Prints a table (median CTA), writes $OUT/fill_bench.json.
    here:   python benchmarks/fill_bench.py --prebuild   (.build/fill_bench.cubin; carry it)
    device: python benchmarks/fill_bench.py [--quick] [--modes 2,5,10] [--tokens 256]"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
SRC = os.path.join(ROOT, "benchmarks/fill_bench.cu")
CUBIN = os.path.join(ROOT, ".build/fill_bench.cubin")
ROWS, MAX_STAGES = 64, 6  # fill_bench.cu kRows, kMaxStages
T, D, K = 8192, 2048, 8  # Qwen3-30B-A3B's tokens, hidden, top-k: x rows through routes


def build(cubin: str = CUBIN) -> str:
    os.makedirs(os.path.dirname(cubin), exist_ok=True)
    cmd = ["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-cubin",
           "-DMOKGEN_SPIN_LIMIT=(1u<<24)", "-Xptxas", "-v",
           "-I", os.path.join(ROOT, "mokgen/runtime/include"), SRC, "-o", cubin]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stderr


# fill_pair: two CTAs, each gathering half the rows (13: + a TMA operand; 14: uncoupled, the
# cross-CTA release skipped: timing only, rows may race; 15: its remote arrival .relaxed.cluster,
# 16: .release.cta; 10: .release.cluster)
PAIR, PAIR_A, PAIR_U, PAIR_R, PAIR_C = 10, 13, 14, 15, 16
# fill_pair's modes -> its `remote` argument (fill_bench.cu: how the peer's stage is freed)
PAIR_REMOTE = {PAIR: 0, PAIR_A: 0, PAIR_U: 1, PAIR_R: 2, PAIR_C: 3}


def smem_bytes(stages: int, boxes: int, mode: int) -> int:
    a = 2 * ROWS * 128 if mode in (4, 12, PAIR_A) else 0  # the TMA operand
    return 1024 + stages * (ROWS * 128 * boxes + a) + 3 * MAX_STAGES * 8  # 1024: alignment


def expected_slice(src_h, table_h, mode: int, boxes: int, s: int, n_rows: int = T) -> torch.Tensor:
    """CTA 0's slice s as fill_bench.cu lays it out: box j (64 columns) 8 KB, row r at
    r * 128, its 16-byte chunk c at (c ^ (r & 7)) * 16 (the 128B swizzle); uint8."""
    col0 = (s % (D // (64 * boxes))) * 64 * boxes
    toks = [(s * ROWS) % n_rows + r for r in range(ROWS)] if mode in (2, 7) else \
        [int(table_h[(s * ROWS + r) % (T * K)]) for r in range(ROWS)]
    out = torch.empty(boxes, ROWS, 8, 16, dtype=torch.uint8)
    for r, tok in enumerate(toks):
        row = src_h[tok, col0:col0 + 64 * boxes].contiguous().view(torch.uint8).view(boxes, 8, 16)
        for c in range(8):
            out[:, r, c ^ (r & 7)] = row[:, c]
    return out.reshape(-1)


def variants(quick: bool):
    """(mode, warps, stages, boxes, hold, ctas, wait); ctas 0: one a multiprocessor; wait:
    fill_bench.cu bench_wait's kind (0 try_wait, 1 test_wait spin, 2 try_wait, 20 ns hint)"""
    out = [(2, 1, 4, 4, 0), (0, 4, 4, 4, 0), (1, 4, 4, 4, 0), (3, 4, 4, 4, 0), (4, 4, 4, 4, 0)]
    for w in (1, 2, 4, 8):
        out += [(0, w, 4, 4, 0)]
    for s in (3, 6):
        out += [(0, 4, s, 4, 0), (2, 1, s, 4, 0)]
    out += [(0, 4, 4, 2, 0), (2, 1, 4, 2, 0)]  # K-major-like: 128-column rows
    for m in (5, 6, 7, 8, 9):  # the megakernel's addressing; cp.async, registers, in order, TMA
        out += [(m, w, 4, b, 0) for w in (2, 4, 8) for b in (4, 2)]
    out += [(5, 4, s, 2, h) for s in (4, 6) for h in (0, 1024)]  # Wgrad2's 256-byte rows
    out += [(PAIR, 4, s, b, 0) for s in (4, 6) for b in (4, 2)]
    out += [(11, w, 4, b, 0) for w in (4, 8) for b in (4, 2)]
    # a weight-gradient slice: the gathered rows beside a 16 KB TMA operand, held 1,024 clocks
    # (its 128 x 256 x 64 MMA at the tensor peak) or not
    out += [(m, 4, 4, b, h) for m in (12, PAIR_A) for b in (4, 2) for h in (0, 1024)]
    # with the hold: latency (deeper rings help) or throughput (they do not)
    out += [(m, 4, s, 4, 1024) for m in (PAIR, PAIR_U, PAIR_R, PAIR_C)
            for s in (3, 4, 6)]
    out += [(m, 4, 4, 4, 0) for m in (PAIR_U, PAIR_R, PAIR_C)]
    out += [(m, 4, 4, 2, h) for m in (PAIR_R, PAIR_C) for h in (0, 1024)]
    out += [(m, 4, s, 4, 1024) for m in (12, PAIR_A) for s in (3, 4)]  # 6 x 48 KB: too big
    if not quick:
        out += [(m, w, 4, 4, 1024) for m, w in ((2, 1), (0, 4), (0, 8), (1, 4))]
    # half the SMs: whether a rate a multiprocessor is the SM's or a share of the L2's
    out += [(5, 4, 4, 4, 0, 66), (5, 4, 4, 2, 0, 66), (2, 1, 4, 2, 0, 66), (PAIR, 4, 4, 2, 0, 66)]
    out = [v + (0,) * (7 - len(v)) for v in out]  # ctas and wait 0 where not given
    for wk in (1, 2):  # the waits that never suspend the thread / suspend it briefly
        out += [(m, w, 4, b, 0, 0, wk) for m, w in ((2, 1), (5, 4), (0, 4), (PAIR, 4))
                for b in (4, 2)]
    return list(dict.fromkeys(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--cubin", default=CUBIN)
    ap.add_argument("--slices", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--modes", default="", help="only these modes, e.g. 2,5,10")
    ap.add_argument("--tokens", type=int, default=T,
                    help="rows read: the table's tokens (and in-order modes' rows) below this; "
                         "a few hundred keep them in L2, as the megakernel's shared tiles are")
    a = ap.parse_args()
    if a.prebuild:
        print(build(a.cubin)[-600:])
        return
    from mokgen.harness.bench import time_ms
    from mokgen.runtime import cuda as mc

    mc.ensure_context()
    mod = mc.load_module(a.cubin)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    table = torch.randint(0, a.tokens, (T * K,), device="cuda", generator=g, dtype=torch.int32)
    tmap = mc.make_tensor_map_2d(src, T, D, D * 2, ROWS, 64)
    row_map = mc.make_tensor_map_2d(src, T, D, D * 2, 1, 64)  # mode 9: a box a row
    out = torch.zeros(4 * sms, dtype=torch.int64, device="cuda")
    last = torch.empty(ROWS * 128 * 4, dtype=torch.uint8, device="cuda")
    rows, table_h, src_h = [], table.cpu(), src.cpu()
    only = {int(m) for m in a.modes.split(",") if m}
    for mode, warps, stages, boxes, hold, ctas, wk in variants(a.quick):
        if only and mode not in only:
            continue
        smem = smem_bytes(stages, boxes, mode)
        if mode in PAIR_REMOTE:
            f = mod.function("fill_pair", smem)
            args = [src, table, T * K, D, tmap, a.tokens, int(mode == PAIR_A), stages, boxes,
                    a.slices, hold, wk, PAIR_REMOTE[mode], out, last]
            grid, block = (ctas or sms) - (ctas or sms) % 2, 32 * 6
        else:
            f = mod.function("fill_bench", smem)
            args = [src, table, T * K, D, tmap, row_map, a.tokens, mode, warps, stages, boxes,
                    a.slices, hold, wk, out, last]
            grid, block = ctas or sms, 32 * 9
        stream = torch.cuda.current_stream()
        run = lambda: mc.launch(f, grid, block, smem, stream, args)  # noqa: E731
        out.zero_()  # fill_pair writes no issue / wait words
        last.fill_(0xAA)  # poisoned: the check fails unless the fill wrote every byte
        ms = time_ms(run, a.iters, warmup=2)
        want = expected_slice(src_h, table_h, mode, boxes, a.slices - 1, a.tokens)
        ok = torch.equal(last[:want.numel()].cpu(), want) or mode == PAIR_U  # timing only
        clk = sorted(out[0:4 * grid:4].tolist())[grid // 2]
        # thread 0's clocks issuing a slice / waiting for an empty stage (modes 2, 5-11)
        issue = sorted(out[2:4 * grid:4].tolist())[grid // 2] / a.slices
        wait = sorted(out[3:4 * grid:4].tolist())[grid // 2] / a.slices
        stage_bytes = ROWS * 128 * boxes  # the gathered rows (mode 4's TMA operand not counted)
        r = dict(mode=mode, warps=warps, stages=stages, boxes=boxes, hold=hold, ctas=grid, wait=wk,
                 ms=ms,
                 ok=ok, issue_clk_slice=issue, empty_wait_clk_slice=wait,
                 clocks_median=clk, bytes_per_clk_sm=a.slices * stage_bytes / clk,
                 gb_s=grid * a.slices * stage_bytes / ms / 1e6)
        rows.append(r)
        print(f"mode {mode} warps {warps} stages {stages} boxes {boxes} hold {hold}: "
              f"{r['bytes_per_clk_sm']:.1f} B/clk/SM, {r['gb_s']:.0f} GB/s, {ms:.3f} ms, "
              f"{'rows right' if ok else 'ROWS WRONG'}", flush=True)
    names = {0: "cp.async+noinc", 1: "cp.async+groups", 2: "TMA in order",
             3: "cp.async+noinc, 1 waiter", 4: "cp.async+noinc beside a TMA operand",
             5: "cp.async, tokens shuffled, unrolled", 6: "ld.global+st.shared, 4 a lane",
             7: "cp.async, shuffled, rows in order", 8: "ld.global+st.shared, 16 a lane",
             9: "TMA, a box a row, lane 0 a warp", 11: "mode 5, copies waited before arriving",
             PAIR: "pair: half the rows a CTA by cp.async, DSMEM bulk to the peer",
             12: "mode 5 beside a TMA operand", PAIR_A: "pair beside a TMA operand",
             PAIR_U: "pair, uncoupled (timing only)", PAIR_R: "pair, relaxed remote release",
             PAIR_C: "pair, remote release.cta"}
    cols = ("mode", "warps", "stages", "row bytes", "hold clk", "CTAs", "wait", "B/clk/SM",
            "GB/s", "rows", "clk a slice", "issue clk", "empty-wait clk")
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print(f"| {names[r['mode']]} | {r['warps']} | {r['stages']} | {128 * r['boxes']} | "
              f"{r['hold']} | {r['ctas']} | {r['wait']} | {r['bytes_per_clk_sm']:.1f} | "
              f"{r['gb_s']:.0f} | {'right' if r['ok'] else 'WRONG'} | "
              f"{r['clocks_median'] / a.slices:.0f} | {r['issue_clk_slice']:.0f} | "
              f"{r['empty_wait_clk_slice']:.0f} |")
    path = os.path.join(os.environ.get("OUT", "."), "fill_bench.json" if a.tokens == T
                        else f"fill_bench_tokens{a.tokens}.json")
    with open(path, "w") as fh:
        json.dump(dict(commit=os.environ.get("MOKGEN_COMMIT", "?"), tokens=a.tokens,
                       gpu=torch.cuda.get_device_name(0), rows=rows), fh, indent=1)
    if not all(r["ok"] for r in rows):
        sys.exit("fill_bench: a variant's rows are wrong")


if __name__ == "__main__":
    main()
