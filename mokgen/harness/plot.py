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


def plot_peers(json_path: str, png_path: str, peer: str = "sonicmoe",
               peer_name: str = "SonicMoE") -> None:
    """Two panels of a peers JSON (benchmarks/peers_sonicmoe.py): forward and training-step
    TFLOP/s per shape (mokgen, mokgen with fused accumulation, the peer), and peak MB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(json_path))
    rows = data["rows"]
    labels = [r["shape"] for r in rows]
    fig, (ax, mx) = plt.subplots(1, 2, figsize=(max(10, len(rows) * 2.2), 4.5))
    bars = (("mokgen_fwd_tflops", "mokgen fwd"), (f"{peer}_fwd_tflops", f"{peer_name} fwd"),
            ("mokgen_train_tflops", "mokgen train"),
            ("mokgen_fused_train_tflops", "mokgen train, fused accumulation"),
            (f"{peer}_train_tflops", f"{peer_name} train"))
    _grouped_bars(ax, rows, labels, bars, "TFLOP/s  (6 T k D I / t, x3 for train)")
    mem = (("mokgen_peak_mb", "mokgen"), ("mokgen_fused_peak_mb", "mokgen, fused"),
           (f"{peer}_peak_mb", peer_name))
    _grouped_bars(mx, rows, labels, mem, "peak MB of a training step (workspace included)")
    fig.suptitle(f"mokgen vs {peer_name}, whole layer at ep = 1 on one {data.get('gpu', '?')} "
                 f"(commit {data.get('commit', '?')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def _grouped_bars(ax, rows, labels, bars, ylabel: str) -> None:
    """One group of bars per row, one bar per (key, legend) of `bars` that any row has (an
    older run lacks the newer columns)."""
    bars = [b for b in bars if any(r.get(b[0]) for r in rows)]
    width = 0.8 / len(bars)
    for i, (key, name) in enumerate(bars):
        ax.bar([x + i * width for x in range(len(rows))], [r.get(key) or 0.0 for r in rows],
               width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
