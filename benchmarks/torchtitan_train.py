"""Training torchtitan MoE models on real text, through torchtitan's own MoE and through mokgen.

One `run` trains one model with one implementation and one seed (a chunk sized for one
10-minute GPU call) and writes that run's JSON; `report` gathers runs into
benchmarks/results/torchtitan_<model>.json (`loss`, `tokens_per_s`, `peak_mb` per
implementation, and whether mokgen's curve stays inside the band of torchtitan's seeds) and a
PNG of the loss curves.

Both implementations train under one configuration: torchtitan's model config, its
parallelize function (FSDP2 with bf16 parameters and fp32 reductions, its selective or full
activation checkpointing, per-block torch.compile), its AdamW, warmup + decay schedule,
gradient clipping and load-balancing hook; mokgen enters only through its override
(mokgen.integrations.torchtitan.mokgen_moe). Data: real text, tokenized with torchtitan's test
tokenizer, read in order from a start the seed picks; a seed sets the initial weights too, so
the three torchtitan seeds are the noise band and mokgen's seed 0 starts from torchtitan
seed 0's weights and data.

Models: `debug` is torchtitan's Qwen3-MoE debug model (8 layers, dim 256, 64 experts of width
768, top-8); `qwen3-30b-a3b` has Qwen3-30B-A3B's blocks (dim 2048, 32 heads, 128 experts of
width 768, top-8) with as many layers as fit the GPU (--layers; the default from its memory),
and the tokenizer's vocabulary instead of Qwen3's 151,936 (the embedding would be a layer's
worth of memory for ids the tokenizer never makes).

The data folder (--data, default .torchtitan-data/, not in git: carry it to the GPU machine):
  tokenizer.json      torchtitan's tests/assets/tokenizer/tokenizer.json
  *.txt | *.json      the text: torchtitan's tests/assets/c4_test/data.json (JSON lines with a
                      "text" field) where available, else a plain text corpus, e.g. the
                      tiny-shakespeare input.txt of karpathy/char-rnn

Needs torchtitan (pip install 'mokgen[torchtitan]') and a CUDA GPU; `report` needs neither
(matplotlib for the PNG). A GPU machine without a package index gets torchtitan 0.3 as wheels
in a carried folder with its pure-Python needs (spmd_types, torch_checkpointing, tyro,
typeguard, docstring_parser, torchdata), installed with
`pip install --no-index --no-deps --target /tmp/site WHEELS` and /tmp/site on PYTHONPATH; a
carried $MOKGEN_CACHE spares the kernels' first compile. One GPU call per run (about 1-3 min
for debug, more for qwen3-30b-a3b: --max-seconds stops a run before the call's limit), then
the report, for example:

  python benchmarks/torchtitan_train.py run --model debug --impl torchtitan --seed 0 --out $OUT
  python benchmarks/torchtitan_train.py run --model debug --impl torchtitan --seed 1 --out $OUT
  python benchmarks/torchtitan_train.py run --model debug --impl torchtitan --seed 2 --out $OUT
  python benchmarks/torchtitan_train.py run --model debug --impl mokgen --seed 0 --out $OUT
  python benchmarks/torchtitan_train.py run --model debug --impl mokgen --dtype mxfp8 --out $OUT
  python benchmarks/torchtitan_train.py report --model debug RUN_JSON_OR_FOLDER...
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("debug", "qwen3-30b-a3b")
OVERRIDE = "mokgen.integrations.torchtitan.mokgen_moe"
# bytes a Qwen3-30B-A3B block holds per parameter in this training setup: fp32 master,
# fp32 gradient, AdamW's two fp32 moments, FSDP's bf16 unsharded copy
BYTES_PER_PARAM = 18
BLOCK_PARAMS_30B = 128 * 3 * 2048 * 768 + 2048 * (32 + 4 + 4) * 128 + 32 * 128 * 2048
ACTIVATION_RESERVE_GB = 12  # activations, workspace, allocator slack


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train one model with one implementation and seed; "
                                   "write its JSON into --out")
    r.add_argument("--model", choices=MODELS, required=True, help="which model (see above)")
    r.add_argument("--impl", choices=("torchtitan", "mokgen"), required=True,
                   help="torchtitan's own MoE, or mokgen's through its override")
    r.add_argument("--seed", type=int, default=0, help="initial weights and data start")
    r.add_argument("--steps", type=int, default=500, help="optimizer steps (default 500)")
    r.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    r.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    r.add_argument("--layers", type=int, default=None,
                   help="blocks of qwen3-30b-a3b (default: as many as the GPU's memory "
                        "holds); debug keeps its 8")
    r.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW)")
    r.add_argument("--warmup", type=int, default=20, help="warmup steps, then linear decay")
    r.add_argument("--ac", choices=("selective", "full", "none"), default="selective",
                   help="torchtitan's activation checkpointing (default selective)")
    r.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile each block, as torchtitan does (default on)")
    r.add_argument("--dtype", choices=("bf16", "mxfp8"), default="bf16",
                   help="mokgen's precision for the routed experts (--impl mokgen)")
    r.add_argument("--data", default=os.path.join(ROOT, ".torchtitan-data"),
                   help="folder with tokenizer.json and the text (see above)")
    r.add_argument("--out", required=True, help="folder for the run's JSON")
    r.add_argument("--max-seconds", type=float, default=540,
                   help="stop training past this wall time (a call's limit), and say so")
    p = sub.add_parser("report", help="gather run JSONs into benchmarks/results/"
                                      "torchtitan_<model>.json and a PNG of loss curves")
    p.add_argument("--model", choices=MODELS, required=True)
    p.add_argument("runs", nargs="+", help="run JSON files or folders holding them")
    p.add_argument("--smooth", type=int, default=20,
                   help="moving-average window of the band check (steps)")
    p.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"))
    return ap.parse_args(argv)


# ---------------------------------------------------------------- data
def load_tokens(folder: str):
    """All text of the folder, tokenized by its tokenizer.json, as one int64 tensor."""
    import torch
    from tokenizers import Tokenizer

    tok_path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(tok_path):
        raise SystemExit(f"no tokenizer.json in {folder} (see --help: the data folder)")
    tokenizer = Tokenizer.from_file(tok_path)
    texts = []
    for path in sorted(glob.glob(os.path.join(folder, "*"))):
        name = os.path.basename(path)
        if name.startswith("tokenizer"):
            continue
        if name.endswith(".txt"):
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        elif name.endswith(".json") or name.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                texts.extend(json.loads(line)["text"] for line in f if line.strip())
    if not texts:
        raise SystemExit(f"no .txt or .json text in {folder} (see --help: the data folder)")
    ids = [i for t in texts for i in tokenizer.encode(t).ids]
    return torch.tensor(ids, dtype=torch.int64), tokenizer.get_vocab_size()


def batches(tokens, batch: int, seq: int, seed: int):
    """Consecutive windows of seq + 1 tokens, in order, wrapping around, from a start the
    seed picks: (inputs, labels) of [batch, seq]."""
    import torch

    n = tokens.numel()
    gen = torch.Generator().manual_seed(seed)
    pos = int(torch.randint(0, n, (1,), generator=gen))
    while True:
        rows = []
        for _ in range(batch):
            idx = torch.arange(pos, pos + seq + 1) % n
            rows.append(tokens[idx])
            pos = (pos + seq) % n
        block = torch.stack(rows)
        yield block[:, :-1], block[:, 1:]


# ---------------------------------------------------------------- model
def model_config(name: str, vocab: int, layers: int | None):
    from torchtitan.models.qwen3 import model_registry

    if name == "debug":
        cfg = model_registry("debugmodel_moe").model
        if vocab > cfg.vocab_size:
            raise SystemExit(f"the tokenizer's {vocab} ids exceed the debug model's "
                             f"{cfg.vocab_size}")
        return cfg, len(cfg.layers)
    cfg = model_registry("30B-A3B").model
    if layers is None:
        import torch

        total_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
        per_block_gb = BLOCK_PARAMS_30B * BYTES_PER_PARAM / 2**30
        layers = max(1, int((total_gb - ACTIVATION_RESERVE_GB) // per_block_gb))
    cfg.layers = cfg.layers[:layers]
    padded = 256 * math.ceil(vocab / 256)
    cfg.vocab_size = padded
    cfg.tok_embeddings.num_embeddings = padded
    cfg.lm_head.out_features = padded
    return cfg, layers


def build(args, vocab: int):
    import torch
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.qwen3 import parallelize_qwen3
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    parallelism = ParallelismConfig()
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, 1)
    cfg, layers = model_config(args.model, vocab, args.layers)
    set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=False)  # as the trainer does
    # the initial weights are torchtitan's model's under the seed, for both implementations
    # (the converted model's fused weights would draw from the generator in another order)
    model = materialize(cfg, args.seed)
    if args.impl == "mokgen":
        state = {k: v.cpu() for k, v in model.state_dict().items()}
        del model
        options = {"tokens_per_rank": args.batch * args.seq, "dtype": args.dtype}
        apply_overrides(OverrideConfig(imports=[(OVERRIDE, options)]), cfg)
        model = materialize(cfg, args.seed)
        model.load_state_dict(state, strict=True)
        del state
    ac = {"selective": SelectiveAC.Config(), "full": FullAC.Config(), "none": None}[args.ac]
    model = parallelize_qwen3(model, parallel_dims=dims, training=TrainingConfig(),
                              parallelism=parallelism,
                              compile_config=CompileConfig(enable=args.compile),
                              ac_config=ac, dump_folder=args.out)
    return model, dims, layers


def materialize(cfg, seed: int):
    """The model of `cfg` built on the meta device, then on the GPU with torchtitan's
    initializers (which draw from the global generator) under `seed`, as the trainer does."""
    import torch

    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cuda")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states()
    return model


def run(args) -> int:
    import torch
    import torch.distributed as dist
    from torchtitan.components.optimizer import (LRSchedulersContainer, default_adamw,
                                                 register_moe_load_balancing_hook)
    from torchtitan.distributed import utils as dist_utils

    if not torch.cuda.is_available():
        raise SystemExit("run needs a CUDA GPU")
    if args.impl == "torchtitan" and args.dtype != "bf16":
        raise SystemExit("--dtype applies to --impl mokgen (torchtitan's own MoE runs bf16)")
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    tokens, vocab = load_tokens(args.data)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29571", rank=0, world_size=1)
    try:
        model, dims, layers = build(args, vocab)
        optimizers = default_adamw(lr=args.lr).build(model_parts=[model])
        register_moe_load_balancing_hook(optimizers, [model], dims)
        schedulers = LRSchedulersContainer.Config(
            warmup_steps=args.warmup, decay_ratio=0.8, decay_type="linear",
            min_lr_factor=0.1).build(optimizers=optimizers, training_steps=args.steps)
        positions = torch.arange(args.seq, device="cuda").repeat(args.batch, 1)
        masks = model.get_attention_masks(positions=positions)
        data = batches(tokens, args.batch, args.seq, args.seed)
        losses, step_ms = [], []
        torch.cuda.reset_peak_memory_stats()
        for step in range(args.steps):
            if time.time() - t_start > args.max_seconds:
                print(f"stopped at step {step}: past --max-seconds {args.max_seconds}")
                break
            x, y = (t.cuda(non_blocking=True) for t in next(data))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            optimizers.zero_grad()
            logits = model(x, positions=positions, attention_masks=masks)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                     y.flatten())
            loss.backward()
            dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
            optimizers.step()
            schedulers.step()
            torch.cuda.synchronize()
            step_ms.append((time.perf_counter() - t0) * 1e3)
            losses.append(loss.item())
            if step % 50 == 0 or step == args.steps - 1:
                print(f"step {step} loss {losses[-1]:.4f} {step_ms[-1]:.1f} ms", flush=True)
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    finally:
        dist.destroy_process_group()
    steady = sorted(step_ms[10:]) or sorted(step_ms)
    median_ms = steady[len(steady) // 2]
    result = {
        "model": args.model, "impl": args.impl, "dtype": args.dtype, "seed": args.seed,
        "steps_asked": args.steps, "steps_done": len(losses), "loss": losses,
        "step_ms": step_ms, "tokens_per_s": args.batch * args.seq / (median_ms / 1e3),
        "peak_mb": peak_mb, "layers": layers,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "data")},
        "data": {"folder": os.path.basename(os.path.abspath(args.data)),
                 "tokens": int(tokens.numel()), "vocab": vocab},
        **environment(),
    }
    name = f"{args.model}_{label(result)}_s{args.seed}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(result, f)
    print(f"{name}: {len(losses)} steps, {result['tokens_per_s']:,.0f} tokens/s, "
          f"peak {peak_mb:,.0f} MiB")
    return 0 if len(losses) == args.steps else 2


def label(run: dict) -> str:
    return run["impl"] if run["dtype"] == "bf16" else f"{run['impl']}-{run['dtype']}"


def environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import torchtitan

        env["torchtitan"] = torchtitan.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    commit = os.environ.get("MOKGEN_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    env["commit"] = commit
    return env


# ---------------------------------------------------------------- report
def smooth(values: list, window: int) -> list:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def report(args) -> int:
    paths = []
    for item in args.runs:
        paths += sorted(glob.glob(os.path.join(item, f"{args.model}_*.json"))) \
            if os.path.isdir(item) else [item]
    runs = [json.load(open(p)) for p in paths]
    runs = [r for r in runs if r.get("model") == args.model]
    if not runs:
        raise SystemExit(f"no runs of {args.model} in {args.runs}")
    by_impl: dict = {}
    for r in runs:
        by_impl.setdefault(label(r), []).append(r)
    band_runs = by_impl.get("torchtitan", [])
    out = {"model": args.model, "implementations": {}}
    for impl, rs in sorted(by_impl.items()):
        rs.sort(key=lambda r: r["seed"])
        out["implementations"][impl] = {
            "seeds": [r["seed"] for r in rs],
            "loss": {str(r["seed"]): r["loss"] for r in rs},
            "tokens_per_s": {str(r["seed"]): r["tokens_per_s"] for r in rs},
            "peak_mb": {str(r["seed"]): r["peak_mb"] for r in rs},
            "steps_done": {str(r["seed"]): r["steps_done"] for r in rs},
            "environment": {k: rs[0].get(k) for k in ("gpu", "torch", "cuda", "torchtitan",
                                                      "commit")},
            "layers": rs[0]["layers"], "config": rs[0]["config"],
        }
    if len(band_runs) >= 2:
        n = min(len(r["loss"]) for r in runs)
        curves = [smooth(r["loss"][:n], args.smooth) for r in band_runs]
        lo = [min(c[i] for c in curves) for i in range(n)]
        hi = [max(c[i] for c in curves) for i in range(n)]
        out["band"] = {"seeds": [r["seed"] for r in band_runs], "smooth": args.smooth,
                       "steps": n}
        for impl, rs in by_impl.items():
            if impl == "torchtitan":
                continue
            for r in rs:
                c = smooth(r["loss"][:n], args.smooth)
                inside = sum(lo[i] <= c[i] <= hi[i] for i in range(n)) / n
                worst = max(max(lo[i] - c[i], c[i] - hi[i], 0.0) for i in range(n))
                out["band"][f"{impl}_s{r['seed']}"] = {"inside_fraction": inside,
                                                       "worst_excursion": worst}
    os.makedirs(args.results, exist_ok=True)
    path = os.path.join(args.results, f"torchtitan_{args.model.replace('-', '_')}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)
    for impl, d in out["implementations"].items():
        tps = list(d["tokens_per_s"].values())
        mb = list(d["peak_mb"].values())
        print(f"{impl:>16}: seeds {d['seeds']}, tokens/s {sum(tps) / len(tps):,.0f}, "
              f"peak {max(mb):,.0f} MiB, final loss "
              f"{[round(v[-1], 4) for v in d['loss'].values()]}")
    for key, v in out.get("band", {}).items():
        if isinstance(v, dict):
            print(f"{key}: inside the torchtitan band {v['inside_fraction']:.1%} of steps, "
                  f"worst excursion {v['worst_excursion']:.4f}")
    plot(out, path.replace(".json", ".png"), args.smooth)
    return 0


def plot(out: dict, path: str, window: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"torchtitan": "tab:gray", "mokgen": "tab:red", "mokgen-mxfp8": "tab:blue"}
    for impl, d in out["implementations"].items():
        for seed, loss in d["loss"].items():
            ax.plot(smooth(loss, window), color=colors.get(impl, None), lw=1,
                    alpha=0.6 if impl == "torchtitan" else 1.0,
                    label=f"{impl} seed {seed}")
    env = next(iter(out["implementations"].values()))["environment"]
    ax.set(xlabel="step", ylabel=f"training loss ({window}-step mean)",
           title=f"torchtitan {out['model']}: {env.get('gpu')}, commit {env.get('commit')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


def main(argv=None) -> int:
    args = parse(argv)
    return run(args) if args.command == "run" else report(args)


if __name__ == "__main__":
    sys.exit(main())
