"""Where a kernel's warps stall, from an ncu source-page CSV (the GPU machine has ncu):

    /usr/local/cuda/bin/ncu --kernel-name mokgen_bwd --launch-skip 3 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters -o R python3 benchmarks/profile_bwd.py ...
    /usr/local/cuda/bin/ncu -i R.ncu-rep --page source --csv --print-source sass > R.csv
    python benchmarks/ncu_top.py R.csv [--top 40]

Prints the stall reasons' shares over the whole kernel, then the SASS instructions with the
most stall samples, each with its two main reasons and its excess global sectors (uncoalesced
accesses). Samples count every warp, producers' and comm CTAs' waits included: a share is
where warps wait, not by itself what limits the kernel.

--sass S: S is `nvdisasm -g -c kernel.cubin` of the same cubin (the kernels are built with
-lineinfo): each instruction is then shown with its source line, and the samples are also
summed per source line (an inlined helper's line counts all its call sites together).
The CSV's addresses are absolute; the kernel's first instruction is offset 0."""
import argparse
import collections
import csv
import os
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXCESS = "L2 Theoretical Sectors Global Excessive"


def load(path: str) -> tuple[list, list]:
    rows = list(csv.reader(open(path, newline="")))
    head = next(i for i, r in enumerate(rows[:10]) if "Address" in r and "Source" in r)
    return rows[head], rows[head + 1:]


def line_map(path: str) -> dict:
    """SASS offset -> "file:line" from nvdisasm -g output."""
    where, out = "?", {}
    for text in open(path):
        if m := re.match(r'\s*//## File "([^"]+)", line (\d+)', text):
            where = f"{os.path.basename(m.group(1))}:{m.group(2)}"
        elif m := re.match(r"\s*/\*([0-9a-f]{4,})\*/", text):
            out[int(m.group(1), 16)] = where
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--sass", help="nvdisasm -g -c output of the same cubin")
    args = ap.parse_args(argv)
    head, data = load(args.csv)
    col = {k: i for i, k in enumerate(head)}

    def num(r, k) -> float:
        try:
            return float(r[col[k]] or 0)
        except (KeyError, ValueError):
            return 0.0

    total = sum(num(r, SAMPLES) for r in data) or 1.0
    stalls = [k for k in head if k.startswith("stall_") and "Not Issued" not in k]
    shares = sorted(((sum(num(r, k) for r in data) / total, k) for k in stalls), reverse=True)
    print(f"{len(data)} instructions, {total:.0f} samples; stalls: " +
          ", ".join(f"{k[6:]} {100 * v:.1f}%" for v, k in shares[:8]))
    lines = line_map(args.sass) if args.sass else {}
    start = min(int(r[col["Address"]], 16) for r in data)
    src = lambda r: lines.get(int(r[col["Address"]], 16) - start, "?")  # noqa: E731
    for r in sorted(data, key=lambda r: -num(r, SAMPLES))[:args.top]:
        why = sorted(((num(r, k), k[6:]) for k in stalls), reverse=True)[:2]
        print(f"{r[col['Address']]:>16} {100 * num(r, SAMPLES) / total:5.2f}%  " +
              (f"{src(r):26} " if lines else "") +
              f"{r[col['Source']].strip()[:56]:56}  " +
              " ".join(f"{k} {v:.0f}" for v, k in why) +
              (f"  excess {num(r, EXCESS):.0f}" if num(r, EXCESS) else ""))
    if lines:
        per = collections.defaultdict(collections.Counter)
        for r in data:
            for k in stalls:
                per[src(r)][k[6:]] += num(r, k)
        print("per source line:")
        for where, c in sorted(per.items(), key=lambda kv: -sum(kv[1].values()))[:args.top]:
            why = " ".join(f"{k} {v:.0f}" for k, v in c.most_common(2))
            print(f"  {where:30} {100 * sum(c.values()) / total:5.2f}%  {why}")


if __name__ == "__main__":
    main()
