"""Bar chart of a moe_layer results JSON: effective TFLOP/s per slice, every implementation."""
from __future__ import annotations

import json
import sys


BF16_IMPLS = (("mokgen", "mokgen"), ("grouped", "torch _grouped_mm"), ("naive", "naive torch"),
              ("floor", "dense cuBLAS floor"))


def plot(json_path: str, png_path: str, impls=BF16_IMPLS,
         what: str = "MoE layer forward, bf16") -> None:
    """impls: (key, legend) pairs; a row's bar is its `<key>_tflops`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(json_path))
    rows = data["rows"]
    labels = [f"{r['shape'].split('-')[0]}\nep{r['ep']} N{r['tokens']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(10, len(rows) * 0.8), 5))
    width = 0.8 / len(impls)
    for i, (key, name) in enumerate(impls):
        ax.bar([x + i * width for x in range(len(rows))],
               [r.get(f"{key}_tflops", 0.0) for r in rows], width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], labels, fontsize=7)
    ax.set_ylabel("effective TFLOP/s  (6 N (k+1) D I / t)")
    m = data["meta"]
    ax.set_title(f"{what}, per-rank slice on one {m['gpu']} "
                 f"(commit {m['commit']}, torch {m['torch']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    plot(sys.argv[1], sys.argv[2])
