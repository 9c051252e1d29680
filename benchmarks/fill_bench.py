"""How fast one SM fills a ring of shared-memory stages with token rows, outside the
megakernel (benchmarks/fill_bench.cu; benchmarks/NOTES.md, session 13). In the megakernel the
gathered backward's weight-gradient slices (64 rows x 256 columns, cp.async from 4 producer
warps) fill at ~12 bytes a clock an SM against TMA's ~40, and neither more stages, fewer
bytes (zero-filled rows), an L1 carve-out, the arrival mechanism nor the table moved it,
while 2 warps instead of 4 cost 0.6x and half the cp.async a warp gained 7%. This bench
takes the ring alone: every SM streams slices through `stages` stages, one consumer thread
frees each (optionally after `hold` clocks, a 128 x 256 x 64 slice's MMA at peak is 1,024),
for each fill mechanism (mode 0 cp.async + arrive.noinc as the megakernel, 1 cp.async with
commit groups, 2 TMA boxes of rows in order, 3 mode 0 with lane 0 alone polling the empty
barrier, 4 mode 0 beside a 16 KB TMA operand a slice, as a weight-gradient tile's) and
producer warp count. Bytes per clock count the gathered rows only.

Checks: CTA 0's last slice, copied out by the consumer into a poisoned buffer, holds the
source rows it names, bytes where TMA's 128B swizzle puts them (host-side expected layout). Prints bytes per clock an SM per variant (the median CTA),
writes $OUT/fill_bench.json.
    here:   python benchmarks/fill_bench.py --prebuild   (.build/fill_bench.cubin; carry it)
    device: python benchmarks/fill_bench.py [--slices 2048]"""
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


def smem_bytes(stages: int, boxes: int, mode: int) -> int:
    a = 2 * ROWS * 128 if mode == 4 else 0  # mode 4's TMA operand
    return 1024 + stages * (ROWS * 128 * boxes + a) + 2 * MAX_STAGES * 8  # 1024: alignment


def expected_slice(src_h, table_h, mode: int, boxes: int, s: int) -> torch.Tensor:
    """CTA 0's slice s as fill_bench.cu lays it out: box j (64 columns) 8 KB, row r at
    r * 128, its 16-byte chunk c at (c ^ (r & 7)) * 16 (the 128B swizzle); uint8."""
    col0 = (s % (D // (64 * boxes))) * 64 * boxes
    toks = [(s * ROWS) % T + r for r in range(ROWS)] if mode == 2 else \
        [int(table_h[(s * ROWS + r) % (T * K)]) for r in range(ROWS)]
    out = torch.empty(boxes, ROWS, 8, 16, dtype=torch.uint8)
    for r, tok in enumerate(toks):
        row = src_h[tok, col0:col0 + 64 * boxes].contiguous().view(torch.uint8).view(boxes, 8, 16)
        for c in range(8):
            out[:, r, c ^ (r & 7)] = row[:, c]
    return out.reshape(-1)


def variants(quick: bool):
    """(mode, warps, stages, boxes, hold)"""
    out = [(2, 1, 4, 4, 0), (0, 4, 4, 4, 0), (1, 4, 4, 4, 0), (3, 4, 4, 4, 0), (4, 4, 4, 4, 0)]
    for w in (1, 2, 4, 8):
        out += [(0, w, 4, 4, 0)]
    for s in (3, 6):
        out += [(0, 4, s, 4, 0), (2, 1, s, 4, 0)]
    out += [(0, 4, 4, 2, 0), (2, 1, 4, 2, 0)]  # K-major-like: 128-column rows
    if not quick:
        out += [(m, w, 4, 4, 1024) for m, w in ((2, 1), (0, 4), (0, 8), (1, 4))]
    return list(dict.fromkeys(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--cubin", default=CUBIN)
    ap.add_argument("--slices", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.prebuild:
        print(build(a.cubin)[-600:])
        return
    from mokgen.bench import time_ms
    from mokgen.runtime import cuda as mc

    mc.ensure_context()
    mod = mc.load_module(a.cubin)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    table = torch.randint(0, T, (T * K,), device="cuda", generator=g, dtype=torch.int32)
    tmap = mc.make_tensor_map_2d(src, T, D, D * 2, ROWS, 64)
    out = torch.zeros(2 * sms, dtype=torch.int64, device="cuda")
    last = torch.empty(ROWS * 128 * 4, dtype=torch.uint8, device="cuda")
    rows, table_h, src_h = [], table.cpu(), src.cpu()
    for mode, warps, stages, boxes, hold in variants(a.quick):
        smem = smem_bytes(stages, boxes, mode)
        f = mod.function("fill_bench", smem)
        args = [src, table, T * K, D, tmap, T, mode, warps, stages, boxes, a.slices, hold, out,
                last]
        run = lambda: mc.launch(f, sms, 32 * 9, smem, torch.cuda.current_stream(), args)  # noqa: E731
        last.fill_(0xAA)  # poisoned: the check fails unless the fill wrote every byte
        ms = time_ms(run, a.iters, warmup=2)
        want = expected_slice(src_h, table_h, mode, boxes, a.slices - 1)
        ok = torch.equal(last[:want.numel()].cpu(), want)
        clk = sorted(out[0::2].tolist())[sms // 2]
        stage_bytes = ROWS * 128 * boxes  # the gathered rows (mode 4's TMA operand not counted)
        r = dict(mode=mode, warps=warps, stages=stages, boxes=boxes, hold=hold, ms=ms, ok=ok,
                 clocks_median=clk, bytes_per_clk_sm=a.slices * stage_bytes / clk,
                 gb_s=sms * a.slices * stage_bytes / ms / 1e6)
        rows.append(r)
        print(f"mode {mode} warps {warps} stages {stages} boxes {boxes} hold {hold}: "
              f"{r['bytes_per_clk_sm']:.1f} B/clk/SM, {r['gb_s']:.0f} GB/s, {ms:.3f} ms, "
              f"{'rows right' if ok else 'ROWS WRONG'}", flush=True)
    names = {0: "cp.async+noinc", 1: "cp.async+groups", 2: "TMA in order",
             3: "cp.async+noinc, 1 waiter", 4: "cp.async+noinc beside a TMA operand"}
    print("\n| mode | warps | stages | row bytes | hold clk | B/clk/SM | GB/s | rows |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {names[r['mode']]} | {r['warps']} | {r['stages']} | {128 * r['boxes']} | "
              f"{r['hold']} | {r['bytes_per_clk_sm']:.1f} | {r['gb_s']:.0f} | "
              f"{'right' if r['ok'] else 'WRONG'} |")
    path = os.path.join(os.environ.get("OUT", "."), "fill_bench.json")
    with open(path, "w") as fh:
        json.dump(dict(commit=os.environ.get("MOKGEN_COMMIT", "?"),
                       gpu=torch.cuda.get_device_name(0), rows=rows), fh, indent=1)
    if not all(r["ok"] for r in rows):
        sys.exit("fill_bench: a variant's rows are wrong")


if __name__ == "__main__":
    main()
