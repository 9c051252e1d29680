"""Render the documentation's generated tables: docs/performance.md whole and the README's
results table (between its `results:begin` / `results:end` markers) from the results files
benchmarks/results/*.json, and docs/training.md's memory table (between `memory:begin` /
`memory:end`) from the planner's memory report. The numbers in the documentation come from
here and nowhere else, so they cannot drift from the results files or the code;
tests/test_docs.py fails when a committed copy is out of date.

    python docs/render_performance.py           # rewrite what is out of date
    python docs/render_performance.py --check   # exit 1 if anything is out of date

Every row names the GPU and the commit that measured it; each results file holds the latest
run per GPU kind (rows of several GPUs stand side by side). A file that is missing renders
as "not measured".
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PERFORMANCE = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
TRAINING = ROOT / "docs" / "training.md"
BEGIN = "<!-- results:begin: rendered by docs/render_performance.py; do not edit by hand -->"
END = "<!-- results:end -->"
MEMORY_BEGIN = "<!-- memory:begin: rendered by docs/render_performance.py; do not edit by hand -->"
MEMORY_END = "<!-- memory:end -->"

# The README's rows: a few of each benchmark (docs/performance.md has them all).
README_MODELS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "mixtral-8x22b")
README_MULTIGPU_LOAD = "ep64"


# ---------------------------------------------------------------- helpers
def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())


def gpu(row: dict) -> str:
    return str(row.get("gpu") or "?").removeprefix("NVIDIA ")


def num(v, digits: int = 0) -> str:
    """A number for a table: thousands separated, '-' where missing or not a number."""
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        return "-"
    return f"{v:,.{digits}f}"


def ratio(a, b) -> str:
    """a / b as a speed-up, '-' where either is missing."""
    if not all(isinstance(v, (int, float)) and v == v and v for v in (a, b)):
        return "-"
    return f"{a / b:.2f}x"


def tflops(flops, ms) -> float | None:
    if not isinstance(ms, (int, float)) or not ms or ms != ms:
        return None
    return flops / ms / 1e9


def wrap(text: str) -> str:
    return textwrap.fill(text, 95, break_on_hyphens=False, break_long_words=False)


def is_preset(name: str) -> bool:
    sys.path.insert(0, str(ROOT))
    from mokgen import shapes

    return name in shapes.names()


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def by_gpu(rows: list[dict]) -> list[dict]:
    """Rows grouped by GPU kind (the file's order within one)."""
    kinds = list(dict.fromkeys(gpu(r) for r in rows))
    return [r for k in kinds for r in rows if gpu(r) == k]


def runs_line(data: dict) -> str:
    """The runs' versions and notes, one line each."""
    out = []
    for r in data.get("runs", []):
        bits = [f"{gpu(r)}: torch {r.get('torch', '?')}, CUDA {r.get('cuda', '?')}, "
                f"commit {r.get('commit', '?')}"]
        if r.get("world"):
            bits.append(f"{r['world']} GPUs")
        if r.get("nccl"):
            bits.append(f"NCCL {r['nccl']}")
        if r.get("time"):
            bits.append(str(r["time"]))
        line = "- " + ", ".join(bits)
        if r.get("note"):
            line += f". Note: {r['note']}"
        out.append(textwrap.fill(line, 95, subsequent_indent="  ", break_on_hyphens=False,
                                 break_long_words=False))
    return "\n".join(out)


def section(title: str, name: str, intro: str, render) -> str:
    data = load(name)
    head = f"## {title}\n\n" + wrap(f"From `benchmarks/results/{name}.json`. {intro}") + "\n\n"
    if data is None or not data.get("rows"):
        return head + "Not measured yet.\n"
    return head + render(data) + "\n\nRuns:\n" + runs_line(data) + "\n"


# ---------------------------------------------------------------- docs/performance.md
def layer_slices(data: dict) -> str:
    rows = []
    for r in by_gpu(data["rows"]):
        b = r.get("backward") or {}
        rows.append([gpu(r), r["commit"], r["shape"], str(r["ep"]), num(r["tokens"]),
                     num(r["mokgen_tflops"]), num(r["grouped_tflops"]), num(r["naive_tflops"]),
                     num(r["floor_tflops"]), ratio(r["grouped_ms"], r["mokgen_ms"]),
                     num(b.get("mokgen_tflops")), num(b.get("grouped_tflops")),
                     num(b.get("floor_tflops")), ratio(b.get("grouped_ms"), b.get("mokgen_ms"))])
    return table(["GPU", "commit", "shape", "ep", "N", "fwd", "grouped_mm", "naive", "floor",
                  "x grouped_mm", "bwd", "grouped_mm bwd", "bwd floor", "bwd x grouped_mm"],
                 rows)


def models(data: dict) -> str:
    rows = []
    for r in by_gpu(data["rows"]):
        t_ours = tflops(3 * r["flops"], r.get("train_mokgen_ms"))
        t_base = tflops(3 * r["flops"], r.get("train_grouped_ms"))
        rows.append([gpu(r), r["commit"], r["shape"], str(r["ep"]), num(r["tokens"]),
                     num(r["mokgen_tflops"]), num(r["grouped_tflops"]),
                     ratio(r["grouped_ms"], r["mokgen_ms"]), num(t_ours), num(t_base),
                     ratio(r.get("train_grouped_ms"), r.get("train_mokgen_ms"))])
    return table(["GPU", "commit", "model", "ep", "N", "fwd", "grouped_mm fwd", "x",
                  "train", "grouped_mm train", "x"], rows)


def sonicmoe(data: dict) -> str:
    rows, sustained, memory, fp8_rows = [], [], [], []
    for r in by_gpu(data["rows"]):
        shape = f"{r['shape']} (T {r['T']}, D {r['D']}, I {r['I']}, E {r['E']}, k {r['k']})"
        if r.get("mokgen_fp8_train_tflops") is not None:  # peers_sonicmoe.py --dtypes bf16,fp8
            # *: measured before the steps marked the weights changed (quantized once)
            commit = r["commit"] + ("" if r.get("steps_change_weights") else "*")
            fp8_rows.append([gpu(r), commit, r["shape"], num(r["mokgen_fp8_fwd_tflops"]),
                             num(r["mokgen_fp8_train_tflops"]),
                             num(r.get("mokgen_fp8_fused_train_tflops")),
                             num(r.get("sonicmoe_train_tflops")),
                             ratio(r["mokgen_fp8_train_tflops"], r.get("sonicmoe_train_tflops")),
                             num(r.get("mokgen_fp8_fused_peak_mb")),
                             num(r.get("mokgen_fp8_peak_fresh_mb")),
                             num(r.get("sonicmoe_peak_mb")), num(r.get("sonicmoe_peak_fresh_mb"))])
        rows.append([gpu(r), r["commit"], shape, num(r["mokgen_fwd_tflops"]),
                     num(r["sonicmoe_fwd_tflops"]), num(r["mokgen_train_tflops"]),
                     num(r.get("mokgen_fused_train_tflops")), num(r["sonicmoe_train_tflops"]),
                     num(r.get("mokgen_train_fresh_tflops")),
                     num(r.get("sonicmoe_train_fresh_tflops"))])
        if r.get("mokgen_fused_train_sustained_tflops") is not None:
            sustained.append([gpu(r), r["commit"], r["shape"],
                              num(r.get("mokgen_fwd_sustained_tflops")),
                              num(r.get("sonicmoe_fwd_sustained_tflops")),
                              ratio(r.get("mokgen_fwd_sustained_tflops"),
                                    r.get("sonicmoe_fwd_sustained_tflops")),
                              num(r.get("mokgen_fused_train_sustained_tflops")),
                              num(r.get("sonicmoe_train_sustained_tflops")),
                              ratio(r.get("mokgen_fused_train_sustained_tflops"),
                                    r.get("sonicmoe_train_sustained_tflops"))])
        memory.append([gpu(r), r["commit"], r["shape"], num(r.get("mokgen_peak_mb")),
                       num(r.get("mokgen_fused_peak_mb")), num(r.get("sonicmoe_peak_mb")),
                       num(r.get("mokgen_peak_fresh_mb")), num(r.get("sonicmoe_peak_fresh_mb"))])
    out = ["Synced calls (each timed alone, the median of repeated calls), TFLOP/s:", "",
           table(["GPU", "commit", "shape", "fwd", "SonicMoE fwd", "train", "train fused",
                  "SonicMoE train", "train fresh", "SonicMoE train fresh"], rows)]
    if sustained:
        out += ["", wrap("Back to back for 2 s each (the rate a training loop holds at the "
                         "board's power limit), TFLOP/s; the training step is the fused one, "
                         "the default in one process:"), "",
                table(["GPU", "commit", "shape", "fwd", "SonicMoE fwd", "x", "train",
                       "SonicMoE train", "x"], sustained)]
    out += ["", wrap("Peak memory of a training step, MB (workspace included, weights and "
                     "their gradients excluded):"), "",
            table(["GPU", "commit", "shape", "mokgen", "mokgen fused", "SonicMoE",
                   "mokgen fresh", "SonicMoE fresh"], memory)]
    if fp8_rows:
        out += ["", wrap("mokgen in blockwise fp8 against SonicMoE in bf16 (synced; x: the "
                         "training step's ratio), TFLOP/s and peak MB. Each step marks the "
                         "weights changed, as an optimizer step does, so fp8 quantizes them "
                         "in every step; a commit marked * reused one quantization for all "
                         "steps (faster than a training loop sees):"), "",
                table(["GPU", "commit", "shape", "fp8 fwd", "fp8 train", "fp8 train fused",
                       "SonicMoE train", "x", "fp8 peak fused", "fp8 peak fresh",
                       "SonicMoE peak", "SonicMoE peak fresh"], fp8_rows)]
    return "\n".join(out)


def step_ms(row: dict, dtype: str) -> float | None:
    """A format's forward + backward ms in an fp8.py row (None where the backward was not
    timed): the training step's time, what an fp8 step has to beat bf16 on."""
    f, b = row.get(f"{dtype}_ms"), row.get(f"{dtype}_bwd_ms")
    return f + b if f is not None and b is not None else None


def fp8(data: dict) -> str:
    rows, errs = [], []
    for r in by_gpu(data["rows"]):
        rows.append([gpu(r), r["commit"], r["shape"], str(r["ep"]), num(r["tokens"]),
                     num(r["bf16_tflops"]), num(r["fp8_tflops"]), num(r["mxfp8_tflops"]),
                     num(r["grouped_tflops"]), num(r.get("scaled_tflops")),
                     ratio(r["bf16_ms"], r["fp8_ms"]), ratio(r["bf16_ms"], r["mxfp8_ms"]),
                     num(r.get("bf16_bwd_tflops")), num(r.get("fp8_bwd_tflops")),
                     num(r.get("mxfp8_bwd_tflops")),
                     ratio(r.get("bf16_bwd_ms"), r.get("fp8_bwd_ms")),
                     ratio(step_ms(r, "bf16"), step_ms(r, "fp8"))])
        errs.append([gpu(r), r["commit"], r["shape"], str(r["ep"]),
                     num(r.get("fp8_err_vs_bf16"), 3), num(r.get("mxfp8_err_vs_bf16"), 3),
                     num(r.get("fp8_routed_err_vs_bf16"), 3),
                     num(r.get("scaled_err_vs_bf16"), 3),
                     num(r.get("fp8_bwd_err_dx"), 3), num(r.get("mxfp8_bwd_err_dx"), 3)])
    return "\n".join([
        "TFLOP/s (forward 6 N (k + s) D I / t, backward twice that):", "",
        table(["GPU", "commit", "shape", "ep", "N", "bf16", "fp8", "MXFP8", "grouped_mm bf16",
               "scaled_grouped_mm fp8", "fp8 / bf16", "MXFP8 / bf16", "bwd bf16", "bwd fp8",
               "bwd MXFP8", "bwd fp8 / bf16", "step fp8 / bf16"], rows),
        "", wrap("Relative error against the bf16 layer (`||y - y_bf16|| / ||y_bf16||`; "
                 "routed: the routed experts' rows alone, beside torch's scaled_grouped_mm "
                 "pipeline's; dx: the backward's input gradient):"), "",
        table(["GPU", "commit", "shape", "ep", "fp8 y", "MXFP8 y", "fp8 routed",
               "scaled_grouped_mm routed", "fp8 dx", "MXFP8 dx"], errs)])


def model_stack(data: dict) -> str:
    rows = []
    for r in by_gpu(data["rows"]):
        torch_peak = "out of memory" if r.get("torch_oom") else num(r.get("torch_peak_mb"))
        torch_ms = "out of memory" if r.get("torch_oom") else num(r.get("torch_step_ms"), 1)
        keep_h = {True: "on", False: "off"}.get(r.get("keep_h"), "not recorded")
        shape = r["shape"] + (f" ({r['dtype']})" if r.get("dtype") else "")  # mokgen's, not bf16
        rows.append([gpu(r), r["commit"], shape, str(r["layers"]), num(r["tokens"]),
                     "yes" if r["checkpointing"] else "no",
                     "yes" if r["fused_grad_accumulation"] else "no", keep_h,
                     num(r.get("mokgen_workspace_mb")), num(r.get("mokgen_held_mb_per_layer"), 1),
                     num(r.get("mokgen_peak_mb")), torch_peak,
                     num(r.get("mokgen_predicted_mb")), num(r.get("mokgen_measured_mb")),
                     num(r.get("mokgen_step_ms"), 1),
                     torch_ms, ratio(r.get("torch_step_ms"), r.get("mokgen_step_ms"))])
    return table(["GPU", "commit", "shape", "layers", "N", "checkpointing", "fused accumulation",
                  "keep_h", "workspace MB", "held MB / layer", "peak MB", "torch peak MB",
                  "predicted MB", "measured MB", "step ms", "torch step ms", "x"], rows)


def multigpu(data: dict) -> str:
    rows = []
    for r in by_gpu(data["rows"]):
        rows.append([gpu(r), r["commit"], str(r.get("world")), r["shape"],
                     f"{r['load']} (L {r['local_experts']})", num(r["tokens"]),
                     num(r["mokgen_fwd_ms"], 2), num(r["nccl_grouped_fwd_ms"], 2),
                     ratio(r["nccl_grouped_fwd_ms"], r["mokgen_fwd_ms"]),
                     num(r.get("floor_fwd_ms"), 2), num(r["mokgen_train_ms"], 2),
                     num(r["nccl_grouped_train_ms"], 2),
                     ratio(r["nccl_grouped_train_ms"], r["mokgen_train_ms"]),
                     num(r.get("floor_train_ms"), 2)])
    return table(["GPU", "commit", "GPUs", "shape", "load", "N", "fwd ms", "NCCL fwd ms", "x",
                  "fwd floor ms", "train ms", "NCCL train ms", "x", "train floor ms"], rows)


def deepep(data: dict) -> str:
    rows = []
    for r in by_gpu(data["rows"]):
        rows.append([gpu(r), r["commit"], str(r.get("world")), r["shape"],
                     f"{r['load']} (L {r['local_experts']})", num(r["tokens"]),
                     num(r["mokgen_fwd_ms"], 2), num(r["deepep_fwd_ms"], 2),
                     ratio(r["deepep_fwd_ms"], r["mokgen_fwd_ms"]), num(r["mokgen_train_ms"], 2),
                     num(r["deepep_train_ms"], 2),
                     ratio(r["deepep_train_ms"], r["mokgen_train_ms"])])
    return table(["GPU", "commit", "GPUs", "shape", "load", "N", "fwd ms", "DeepEP fwd ms", "x",
                  "train ms", "DeepEP train ms", "x"], rows)


def fsdp_overlap(data: dict) -> str:
    rows = []
    for r in by_gpu(data["rows"]):
        rows.append([gpu(r), r["commit"], str(r.get("world")), r["shape"], r["load"],
                     num(r["tokens"]), r["mode"], str(r["reserve_sms"]), num(r["layer_ms"], 2),
                     num(r["gather_ms"], 2), num(r["overlap_ms"], 2),
                     f"{100 * r['hidden']:.0f}%" if isinstance(r.get("hidden"), (int, float))
                     else "-"])
    return table(["GPU", "commit", "GPUs", "shape", "load", "N", "step", "reserve_sms",
                  "layer ms", "gather ms", "both ms", "gather hidden"], rows)


def training_step(data: dict) -> str:
    rows = []
    for r in by_gpu(data["rows"]):
        rows.append([gpu(r), r["commit"], r["model"], num(r["tokens"]), num(r["ours_ms"], 1),
                     num(r["grouped_ms"], 1), ratio(r["grouped_ms"], r["ours_ms"]),
                     num(r["ours_j_per_step"], 1), num(r["grouped_j_per_step"], 1),
                     num(r["ours_watts"]), num(r["grouped_watts"]), num(r["ours_sm_mhz"]),
                     num(r["grouped_sm_mhz"])])
    return table(["GPU", "commit", "model", "N", "step ms", "grouped_mm step ms", "x",
                  "J / step", "grouped_mm J / step", "W", "grouped_mm W", "SM MHz",
                  "grouped_mm SM MHz"], rows)


def torchtitan_call(r: dict) -> tuple:
    """What makes torchtitan runs comparable: one GPU kind, configuration, step count and
    commit (the runs of one call)."""
    return gpu(r), r["layers"], r["batch"], r["seq"], r["ac"], r["steps"], r["commit"]


def torchtitan_runs(data: dict) -> str:
    """One row per run; each mokgen row against torchtitan's run of the same seed (same
    weights and data; `+graphs` rows against torchtitan's `+graphs` run) and against the band
    of torchtitan's seeds (torchtitan_train.band_check), whose own seeds' excursions follow
    the table as the noise to judge it by. Rows are compared only within one configuration,
    step count and commit: the runs of one call."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from torchtitan_train import OWN_NOISE, band_check

    rows, notes = [], []
    groups: dict = {}
    for r in by_gpu(data["rows"]):
        groups.setdefault(torchtitan_call(r), []).append(r)
    for (kind, *_), runs in groups.items():
        band = band_check(runs, SMOOTH)
        theirs = {(r["impl"], r["seed"]): r for r in runs if r["impl"].startswith("torchtitan")}
        for r in sorted(runs, key=lambda r: (r["impl"] != "torchtitan", r["impl"], r["seed"])):
            b = band.get(f"{r['impl']} seed {r['seed']}")
            graphs = r["impl"].endswith("+graphs") and r["impl"] != "torchtitan+graphs"
            base = (None if r["impl"] == "torchtitan" else
                    theirs.get(("torchtitan+graphs" if graphs else "torchtitan", r["seed"])))
            tail = r["loss"][-SMOOTH:]
            rows.append([kind, r["commit"], r["impl"], str(r["seed"]), str(r["layers"]),
                         num(r["steps_done"]), num(r["tokens_per_s"]),
                         ratio(r["tokens_per_s"], base["tokens_per_s"]) if base else "-",
                         num(r["peak_mb"]), f"{sum(tail) / len(tail):.3f}",
                         f"{100 * b['inside_fraction']:.0f}%" if b else "-",
                         f"{b['worst_excursion']:.4f}" if b else "-"])
        own = band.get(OWN_NOISE)
        if own:
            (f0, f1), (w0, w1) = own["inside_fraction"], own["worst_excursion"]
            notes.append(f"{kind}, {runs[0]['layers']} layers: each torchtitan seed against the "
                         f"others' range is inside {100 * f0:.0f}-{100 * f1:.0f}% of the steps, "
                         f"at worst {w0:.4f}-{w1:.4f} outside.")
    out = table(["GPU", "commit", "MoE", "seed", "layers", "steps", "tokens/s", "x torchtitan",
                 "peak MiB", f"loss (last {SMOOTH})", "inside band", "worst outside"], rows)
    data_line = "; ".join(dict.fromkeys(r.get("data", "?") for r in data["rows"]))
    return (out + "\n\n" + wrap(f"Data: {data_line}.")
            + ("\n\n" + wrap("Noise: " + " ".join(notes)) if notes else "")
            + gpu_parts(data["rows"]))


def gpu_parts(rows: list) -> str:
    """The profiled runs' (--profile) GPU time a step by part (torchtitan_train.GPU_PARTS):
    AdamW's and FSDP2's kernels are the same whatever the MoE, which bounds what any MoE
    layer can do for the step."""
    profiled = [r for r in by_gpu(rows) if r.get("gpu_ms_per_step")]
    if not profiled:
        return ""
    body = [[gpu(r), r["commit"], r["impl"], str(r["seed"])]
            + [num(r["gpu_ms_per_step"].get(k), 1) for k in
               ("optimizer", "fsdp_copies", "mokgen", "rest")] for r in profiled]
    return ("\n\n" + wrap("GPU time a step by part, ms (the profiled steps of runs with "
                           "--profile): AdamW, FSDP2's parameter and gradient copies, mokgen's "
                           "kernels, and the rest (attention, the dense layers and, for "
                           "torchtitan, its MoE):") + "\n\n"
            + table(["GPU", "commit", "MoE", "seed", "AdamW", "FSDP2 copies", "mokgen", "rest"],
                    body))


SMOOTH = 20  # the loss curves' moving average (torchtitan_train.py report's default)


PREAMBLE = """# Performance

Every table below is rendered by `docs/render_performance.py` from the results files in
`benchmarks/results/`; do not edit it by hand. Each results file holds the latest run of one
benchmark per GPU kind, and every row names the GPU (as the driver names it: `H100 80GB HBM3`
is the H100 SXM) and the commit that measured it, with the baseline measured in the same run
on the same inputs. `python docs/render_performance.py`
rewrites this page and the README's table after a benchmark run; `tests/test_docs.py` fails
while they are out of date.

How to read the numbers:

- **Effective TFLOP/s** (the Mixture-of-Kittens paper's metric, `MoEShape.forward_flops`): a
  forward counts `6 N (k + s) D I` FLOPs for N tokens per rank, k routed experts and s = 1
  shared expert (0 without one), each a SwiGLU FFN of width I on hidden size D; the backward
  twice that, a training step (forward + backward) three times that. Higher is better.
- **x** is the baseline's time over mokgen's: above 1.00x mokgen is faster.
- **Per-rank slice** (`ep` > 1 on one GPU): rank 0's share of an expert-parallel deployment,
  its L = E / ep experts receiving every rank's tokens routed to them, run on virtual ranks.
- **Floor**: dense cuBLAS GEMMs of the same FLOPs (and, across GPUs, the bytes that cross
  NVLink over its rate): what no MoE layer can beat on that GPU.
- **Synced** timings are the median of repeated calls with the GPU idle between them;
  **back to back** runs the call continuously for a few seconds, as a training loop does,
  where the board's power limit sets the clock.

"""


def render_performance() -> str:
    parts = [PREAMBLE.rstrip() + "\n"]
    parts.append(section(
        "Layer: the presets' per-rank slices", "moe_layer",
        "`python benchmarks/moe_layer.py`: rank 0's forward and backward of each main preset "
        "at ep 8 and 64, against torch `_grouped_mm` with autograd, a per-expert loop "
        "(naive) and the dense floor; bf16, TFLOP/s.", layer_slices))
    parts.append(section(
        "Public models' layers against torch grouped_mm", "models",
        "`python benchmarks/models.py`: each model's whole layer at ep 1 and rank 0's slice of "
        "a virtual ep 8 deployment (ep 6 for 60 experts), forward and training step, against "
        "`torch._grouped_mm` with autograd on the same inputs; bf16, TFLOP/s.", models))
    parts.append(section(
        "Against SonicMoE (one GPU, whole layer at ep 1)", "peers_sonicmoe",
        "`python benchmarks/peers_sonicmoe.py`: each layer with its own softmax top-k router, "
        "the same tokens and output gradient; bf16. `train` adds into the gradients of the "
        "steps before (gradient accumulation) with autograd adding mokgen's expert gradients "
        "(`fuse_grad_accumulation=False`); `train fused` lets the backward kernel add them "
        "(the default in one process); `fresh` sets the gradients to None before each step.",
        sonicmoe))
    parts.append(section(
        "fp8 and MXFP8", "fp8",
        "`python benchmarks/fp8.py --backward`: the presets' per-rank slices in bf16, "
        "blockwise fp8 and MXFP8 on the same inputs (weights quantized ahead), beside torch's "
        "bf16 grouped_mm and fp8 scaled_grouped_mm pipelines. See docs/fp8.md.", fp8))
    parts.append(section(
        "A model: stacked layers, memory and step time", "model_stack",
        "`python benchmarks/model_stack.py`: N pre-norm residual MoE blocks trained on one GPU, "
        "against the same stack in plain PyTorch (softmax top-k, `torch._grouped_mm`, "
        "autograd); steps accumulate into the first step's gradients. `held` is what stays "
        "allocated after a step beyond weights and gradients, divided by the layers (mokgen's "
        "one shared workspace included); `peak` the most allocated during a step beyond what "
        "was allocated before it. `predicted` is `mokgen.pytorch.api.stack_memory` (held + peak beyond "
        "weights and gradients), `measured` the same bytes as the step allocated "
        "them. See docs/training.md.", model_stack))
    parts.append(section(
        "Several GPUs: expert parallelism against NCCL", "multigpu",
        "`torchrun --nproc-per-node=R benchmarks/multigpu.py`: each GPU carries one rank's load "
        "of a preset's ep 64 or ep 8 deployment (L local experts), against NCCL "
        "`all_to_all_single` + `torch._grouped_mm` (autograd for the training step); slowest "
        "rank's median, ms.", multigpu))
    parts.append(section(
        "Several GPUs: against DeepEP", "peers_deepep",
        "`torchrun --nproc-per-node=2 benchmarks/peers_deepep.py`: DeepEP's intranode dispatch "
        "and combine around `torch._grouped_mm`, on the same loads and inputs; ms.", deepep))
    parts.append(section(
        "Several GPUs: an FSDP all-gather beside the layer", "fsdp_overlap",
        "`torchrun --nproc-per-node=R benchmarks/fsdp_overlap.py`: a 256 MiB all-gather on a "
        "side stream beside one rank's layer, with `reserve_sms` SMs left free "
        "(`overlap_comm=True` plans 16 on an H100 or H200 SXM); event times, ms.", fsdp_overlap))
    for model, what in (("debug", "torchtitan's Qwen3-MoE debug model"),
                        ("qwen3_30b_a3b", "a Qwen3-30B-A3B-shaped model, as many layers as fit")):
        parts.append(section(
            f"torchtitan: {what}", f"torchtitan_{model}",
            "`python benchmarks/torchtitan_train.py run` (docs/torchtitan.md): torchtitan "
            "trains on real text (the "
            "Data line below, tokenized by torchtitan's test tokenizer) through its own MoE "
            "and through mokgen's override, one "
            "configuration (batch 4 x 2048 tokens, FSDP2, selective activation "
            "checkpointing, torch.compile, AdamW); tokens/s from the median step after the "
            "tenth. `x torchtitan` against torchtitan's run of the same seed (same weights and "
            "data; a `+graphs` row against torchtitan's `+graphs` run, and that one against "
            f"its eager run); `inside band` the share of steps the {SMOOTH}-step mean loss lies within "
            f"the range of torchtitan's seeds, `worst outside` its largest distance past it. "
            f"Curves: `benchmarks/results/torchtitan_{model}.png`. See docs/torchtitan.md.",
            torchtitan_runs))
    parts.append(section(
        "Training step energy", "training_step",
        "A training step back to back for a few seconds against torch `_grouped_mm` with "
        "autograd, with the board's energy counter and SM clock.", training_step))
    return "\n".join(parts)


# ---------------------------------------------------------------- the README's table
def readme_table() -> str:
    rows = []
    data = load("models") or {"rows": []}
    for r in by_gpu(data["rows"]):
        if r["shape"] in README_MODELS and r["ep"] == 1 and not r.get("overrides"):
            t_ours = tflops(3 * r["flops"], r.get("train_mokgen_ms"))
            t_base = tflops(3 * r["flops"], r.get("train_grouped_ms"))
            rows.append([f"{r['shape']}, 1 GPU, N {r['tokens']}", gpu(r), r["commit"],
                         f"{num(t_ours)} TFLOP/s", f"torch grouped_mm {num(t_base)} TFLOP/s",
                         ratio(r.get("train_grouped_ms"), r.get("train_mokgen_ms"))])
    data = load("peers_sonicmoe") or {"rows": []}
    for r in by_gpu(data["rows"]):
        ours, theirs = r.get("mokgen_fused_train_sustained_tflops"), \
            r.get("sonicmoe_train_sustained_tflops")
        if ours is not None:
            name = r["shape"] if is_preset(r["shape"]) else \
                f"{r['shape']} (E {r['E']}, D {r['D']}, I {r['I']}, k {r['k']})"
            rows.append([f"{name}, 1 GPU, N {r['T']}", gpu(r), r["commit"],
                         f"{num(ours)} TFLOP/s", f"SonicMoE {num(theirs)} TFLOP/s",
                         ratio(ours, theirs)])
    data = load("model_stack") or {"rows": []}
    deepest = {}  # per GPU, one stack PyTorch cannot train: fused accumulation first, then
    for r in by_gpu(data["rows"]):  # Qwen3-30B-A3B, then the most layers
        if (r.get("torch_oom") and not r["checkpointing"] and not r.get("mokgen_oom")
                and not r.get("dtype")):  # bf16 against bf16
            rank = (bool(r.get("fused_grad_accumulation")), r["shape"] == "qwen3-30b-a3b",
                    r["layers"])
            if gpu(r) not in deepest or rank > deepest[gpu(r)][0]:
                deepest[gpu(r)] = (rank, r)
    for _, r in deepest.values():
        rows.append([f"{r['layers']} layers of {r['shape']}, 1 GPU, N {r['tokens']}",
                     gpu(r), r["commit"], f"{num(r['mokgen_step_ms'])} ms",
                     "PyTorch: out of memory", "-"])
    data = load("torchtitan_qwen3_30b_a3b") or {"rows": []}
    base = {(torchtitan_call(r), r["seed"]): r for r in data["rows"]
            if r["impl"] == "torchtitan"}
    latest = {gpu(r): r["commit"] for r in data.get("runs", [])}
    for r in by_gpu(data["rows"]):  # mokgen against torchtitan's run of the same seed
        b = base.get((torchtitan_call(r), r["seed"]))
        if r["impl"] == "mokgen" and b and r["commit"] == latest.get(gpu(r), r["commit"]):
            rows.append([f"torchtitan, Qwen3-30B-A3B-shaped, {r['layers']} layers, 1 GPU",
                         gpu(r), r["commit"], f"{num(r['tokens_per_s'])} tokens/s",
                         f"torchtitan's MoE {num(b['tokens_per_s'])} tokens/s",
                         ratio(r["tokens_per_s"], b["tokens_per_s"])])
    data = load("multigpu") or {"rows": []}
    for r in by_gpu(data["rows"]):
        if r["load"] == README_MULTIGPU_LOAD:
            rows.append([f"{r['shape']}, {r['world']} GPUs, {r['local_experts']} experts and "
                         f"N {r['tokens']} a GPU", gpu(r), r["commit"],
                         f"{num(r['mokgen_train_ms'], 2)} ms",
                         f"NCCL all_to_all + grouped_mm {num(r['nccl_grouped_train_ms'], 2)} ms",
                         ratio(r["nccl_grouped_train_ms"], r["mokgen_train_ms"])])
    return table(["training step", "GPU", "commit", "mokgen", "baseline, same run", "x"], rows)


def replace_block(text: str, begin: str, end: str, content: str, name: str) -> str:
    """`text` with what lies between the markers `begin` and `end` replaced by `content`
    (ValueError if a marker is missing)."""
    head, sep, rest = text.partition(begin)
    _, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise ValueError(f"{name} must hold the markers {begin!r} and {end!r}")
    return head + begin + "\n" + content + "\n" + end + tail


def render_readme(text: str) -> str:
    """The README with its results table re-rendered."""
    return replace_block(text, BEGIN, END, readme_table(), "README.md")


# ---------------------------------------------------------------- docs/training.md
# (label, preset, ep, tokens per rank, dtype, plan keywords)
MEMORY_MODES = (
    ("default: each call keeps its h (keep_h)", "qwen3-30b-a3b", 1, 8192, "bf16", {}),
    ("h in the shared ring", "qwen3-30b-a3b", 1, 8192, "bf16", {"keep_h": False}),
    ("gathered rows", "qwen3-30b-a3b", 1, 8192, "bf16", {"dispatch": "gather"}),
    ("forward gathers, backward copies x into a window", "qwen3-30b-a3b", 1, 8192, "bf16",
     {"dispatch": "gather", "reverse_combine": "pull"}),
    ("blockwise fp8", "qwen3-30b-a3b", 1, 8192, "fp8", {}),
    ("one rank of ep 8", "kimi-k2.7", 8, 2048, "bf16", {}),
    ("one rank of ep 64", "kimi-k2.7", 64, 2048, "bf16", {}),
)


def memory_table() -> str:
    """The memory each mode costs, from mokgen.pytorch.api.memory_report (no GPU)."""
    sys.path.insert(0, str(ROOT))
    import mokgen
    from mokgen.pytorch.api import memory_report

    mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    rows = []
    for label, name, ep, tokens, dtype, kw in MEMORY_MODES:
        plan = mokgen.plan(mokgen.shapes.get(name), ep=ep, dtype=dtype, tokens_per_rank=tokens,
                           **kw)
        rep = memory_report(plan)
        keywords = ", ".join(f"{k}={v!r}" for k, v in kw.items()) or "-"
        if plan.keep_h:
            replay = "never"
        else:
            replay = "in each layer's backward but the last, unless checkpointed"
            if plan.expected_replay_rows:
                replay += f"; {plan.expected_replay_rows:,} rows a call past the ring"
        rows.append([label, f"{name}, ep {ep}, {dtype}, {tokens:,} tokens", keywords,
                     mib(rep["workspace"]["total"]), "yes" if rep["wg_acc"] else "no",
                     mib(rep["saved_per_layer"]), replay])
    shape = mokgen.shapes.get("qwen3-30b-a3b")
    grads = shape.num_experts * 3 * shape.intermediate * shape.hidden * 2
    return (table(["mode", "layer", "plan keywords", "workspace MiB, once", "fp32 weight-gradient "
                   "sums", "kept per layer call MiB", "backward replays gate/up"], rows)
            + "\n\n" + wrap(f"Fused gradient accumulation saves, in each backward that adds "
                            f"into existing gradients, a temporary the size of the layer's "
                            f"expert weights: {mib(grads)} MiB a layer for qwen3-30b-a3b at "
                            f"ep 1."))


def render_training(text: str) -> str:
    """docs/training.md with its memory table re-rendered."""
    return replace_block(text, MEMORY_BEGIN, MEMORY_END, memory_table(), "docs/training.md")


def rendered() -> dict:
    """path -> what it should hold."""
    return {PERFORMANCE: render_performance(), README: render_readme(README.read_text()),
            TRAINING: render_training(TRAINING.read_text())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if a rendered file is out of date")
    args = ap.parse_args(argv)
    want = rendered()
    stale = [p for p, text in want.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"out of date: {p.relative_to(ROOT)} (run python docs/render_performance.py)")
        return 1 if stale else 0
    for p in stale:
        p.write_text(want[p])
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
