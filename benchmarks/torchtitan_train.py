"""Training torchtitan MoE models on real text, through torchtitan's own MoE and through mokgen.

One `run` trains one model with one implementation and one seed (a chunk sized for one
10-minute GPU call) and writes its row — `loss` (every step's), `tokens_per_s`, `peak_mb` —
into OUT/torchtitan_<model>.json (rows per GPU kind, benchmarks/result_file.py: fold a GPU
machine's file into benchmarks/results/ with `result_file.py merge`). `report` reads that
file: per GPU, whether each mokgen curve stays inside the band of torchtitan's seeds, the
tokens/s and peak memory side by side, and a PNG of the loss curves beside the JSON.

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

The data folder (--data, default .torchtitan/data/, not in git: carry .torchtitan/ to the GPU
machine; benchmarks/peers/fetch_torchtitan.sh fills it, with the wheels in .torchtitan/whl/):
  tokenizer.json      torchtitan's tests/assets/tokenizer/tokenizer.json
  *.txt | *.json      the text: torchtitan's tests/assets/c4_test/data.json (JSON lines with a
                      "text" field) where available, else a plain text corpus, e.g. the
                      tiny-shakespeare input.txt of karpathy/char-rnn
  SOURCE              the text's address (fetch_torchtitan.sh writes it), named in each row

Needs torchtitan (the torchtitan extra: pip install -e '.[torchtitan]') and a CUDA GPU;
`report` needs neither (matplotlib for the PNG). On the GPU machine
`bash benchmarks/run_gpu.sh torchtitan MODEL RUN...` installs the carried wheels and runs each
RUN (IMPL:SEED, IMPL one of torchtitan, mokgen, mokgen-fp8, mokgen-mxfp8) as a step of the
call; one run takes about 1-3 minutes for debug, more for qwen3-30b-a3b (--max-seconds stops
a run before the call's limit). By hand:

  python benchmarks/torchtitan_train.py run --model debug --impl torchtitan --seed 0 --out DIR
  python benchmarks/torchtitan_train.py run --model debug --impl mokgen --seed 0 --out DIR
  python benchmarks/torchtitan_train.py run --model debug --impl mokgen --dtype fp8 --out DIR
  python benchmarks/torchtitan_train.py report --model debug [--results DIR]
  MOKGEN_GPU=h100-sxm python benchmarks/torchtitan_train.py prebuild --pack FILE.tar.xz
      (the runs' kernels compiled here, without a GPU; run_gpu.sh unpacks .kcache/*.tar.xz)
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import result_file  # noqa: E402

MODELS = ("debug", "qwen3-30b-a3b")
REGISTRY = {"debug": "debugmodel_moe", "qwen3-30b-a3b": "30B-A3B"}  # torchtitan's qwen3 names
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
    r.add_argument("--dtype", choices=("bf16", "fp8", "mxfp8"), default="bf16",
                   help="mokgen's precision for the routed experts (--impl mokgen)")
    r.add_argument("--cuda-graphs", action="store_true",
                   help="each step's forward and backward captured once and replayed, "
                        "through torchtitan's own wrap_with_cuda_graph, as its trainer does by "
                        "default (the optimizer step stays eager); rows labelled IMPL+graphs")
    r.add_argument("--data", default=os.path.join(ROOT, ".torchtitan", "data"),
                   help="folder with tokenizer.json and the text (see above)")
    r.add_argument("--out", default=result_file.RESULTS,
                   help="results folder (default: %(default)s; a GPU machine: $OUT/results)")
    r.add_argument("--profile", metavar="STEPS", type=int, default=0,
                   help="torch.profiler over this many steps after step 20: the GPU kernels' "
                        "time table printed and written beside the results, and the row's "
                        "gpu_ms_per_step (AdamW, FSDP2 copies, mokgen, rest; default: none)")
    r.add_argument("--memory-step", metavar="STEP", type=int, default=0,
                   help="record the caching allocator's history over this step: the row's "
                        "memory_peak names what was live at the step's peak, by the Python "
                        "line that allocated it (default: none)")
    r.add_argument("--max-seconds", type=float, default=540,
                   help="stop training past this wall time (a call's limit), and say so")
    p = sub.add_parser("report", help="the band check, tokens/s and peak memory of the runs "
                                      "in a results file, and a PNG of their loss curves")
    p.add_argument("--model", choices=MODELS, required=True)
    p.add_argument("--results", default=result_file.RESULTS,
                   help="folder of torchtitan_<model>.json (default: %(default)s)")
    p.add_argument("--smooth", type=int, default=20,
                   help="moving-average window of the band check and the plot (steps)")
    b = sub.add_parser("prebuild", help="compile the mokgen kernels the runs load, no GPU "
                                        "needed ($MOKGEN_GPU names the GPU kind)")
    b.add_argument("--models", default=",".join(MODELS), help="comma list (default: all)")
    b.add_argument("--dtypes", default="bf16,fp8", help="comma list (default: %(default)s)")
    b.add_argument("--batch", type=int, default=4, help="as run's (default 4)")
    b.add_argument("--seq", type=int, default=2048, help="as run's (default 2048)")
    b.add_argument("--pack", metavar="FILE.tar.xz", default=None,
                   help="also write them to a tarball for the GPU machine (prebuild.py --pack)")
    return ap.parse_args(argv)


# ---------------------------------------------------------------- data
def load_tokens(folder: str):
    """All text of the folder, tokenized by its tokenizer.json: (one int64 tensor, the
    tokenizer's vocabulary size, the text files' names)."""
    import torch
    from tokenizers import Tokenizer

    tok_path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(tok_path):
        raise SystemExit(f"no tokenizer.json in {folder} (see --help: the data folder)")
    tokenizer = Tokenizer.from_file(tok_path)
    texts, names = [], []
    for path in sorted(glob.glob(os.path.join(folder, "*"))):
        name = os.path.basename(path)
        if name.startswith("tokenizer") or name == "SOURCE":
            continue
        if name.endswith(".txt"):
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        elif name.endswith(".json") or name.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                texts.extend(json.loads(line)["text"] for line in f if line.strip())
        else:
            continue
        names.append(name)
    if not texts:
        raise SystemExit(f"no .txt or .json text in {folder} (see --help: the data folder)")
    source = os.path.join(folder, "SOURCE")  # where fetch_torchtitan.sh got the text
    if os.path.exists(source):
        with open(source) as f:
            names.append(f"from {f.read().strip()}")
    ids = [i for t in texts for i in tokenizer.encode(t).ids]
    return torch.tensor(ids, dtype=torch.int64), tokenizer.get_vocab_size(), names


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
        cfg = model_registry(REGISTRY[name]).model
        if vocab > cfg.vocab_size:
            raise SystemExit(f"the tokenizer's {vocab} ids exceed the debug model's "
                             f"{cfg.vocab_size}")
        return cfg, len(cfg.layers)
    cfg = model_registry(REGISTRY[name]).model
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
                              ac_config=ac, dump_folder=os.path.join(args.out, "torchtitan_dump"))
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
    if args.impl == "torchtitan" and args.dtype != "bf16":
        raise SystemExit("--dtype applies to --impl mokgen (torchtitan's own MoE runs bf16)")
    import torch
    import torch.distributed as dist
    from torchtitan.components.optimizer import (LRSchedulersContainer, default_adamw,
                                                 register_moe_load_balancing_hook)
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools.utils import GarbageCollection

    if not torch.cuda.is_available():
        raise SystemExit("run needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    tokens, vocab, texts = load_tokens(args.data)
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
        extra = {"positions": positions, "attention_masks": masks}

        def fwd_bwd(inputs, labels, global_valid_tokens, extra_kwargs):
            """torchtitan's ForwardBackwardFn signature (the loss here is a plain mean:
            global_valid_tokens is not read)."""
            logits = model(inputs, **extra_kwargs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                     labels.flatten())
            loss.backward()
            return loss

        if args.cuda_graphs:  # the first call eager, the second captured, then replays
            from torchtitan.distributed.cudagraph import wrap_with_cuda_graph

            fwd_bwd = wrap_with_cuda_graph(fwd_bwd)
        valid_tokens = torch.tensor(float(args.batch * args.seq), device="cuda")
        data = batches(tokens, args.batch, args.seq, args.seed)
        losses, step_ms, gpu_parts, memory_peak = [], [], None, None
        # as torchtitan's trainer: Python's collector off, a collection every GC_EVERY steps
        # (else a collection lands at random in a step and stalls it)
        gc_handler = GarbageCollection(gc_freq=GC_EVERY)
        torch.cuda.reset_peak_memory_stats()
        for step in range(args.steps):
            if time.time() - t_start > args.max_seconds:
                print(f"stopped at step {step}: past --max-seconds {args.max_seconds}")
                break
            if args.profile and step == PROFILE_FROM:
                prof = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA]).__enter__()
            x, y = (t.cuda(non_blocking=True) for t in next(data))
            torch.cuda.synchronize()
            if args.memory_step and step == args.memory_step:
                base_bytes = torch.cuda.memory_allocated()
                torch.cuda.memory._record_memory_history(context="alloc", stacks="python")
            t0 = time.perf_counter()
            gc_handler.run(step + 1)  # torchtitan's steps count from 1
            # a graph's gradients live in its pool: zeroed in place, as torchtitan's trainer
            optimizers.zero_grad(set_to_none=not args.cuda_graphs)
            loss = fwd_bwd(x, y, valid_tokens, extra)
            dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
            optimizers.step()
            schedulers.step()
            torch.cuda.synchronize()
            step_ms.append((time.perf_counter() - t0) * 1e3)
            losses.append(loss.item())
            if step % 50 == 0 or step == args.steps - 1:
                print(f"step {step} loss {losses[-1]:.4f} {step_ms[-1]:.1f} ms", flush=True)
            if args.memory_step and step == args.memory_step:
                memory_peak = peak_composition(torch.cuda.memory._snapshot(), base_bytes)
                torch.cuda.memory._record_memory_history(enabled=None)
                print(format_peak(memory_peak))
            if args.profile and step == PROFILE_FROM + args.profile - 1:
                prof.__exit__(None, None, None)
                gpu_parts = write_profile(prof, args, step_ms[-args.profile:])
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
        stats = torch.cuda.memory_stats()
    finally:
        dist.destroy_process_group()
    steady = sorted(step_ms[10:]) or sorted(step_ms)  # past compilation and warmup
    median_ms = steady[len(steady) // 2]
    row = {"model": args.model, "impl": label(args.impl, args.dtype, args.cuda_graphs),
           "seed": args.seed,
           "layers": layers, "batch": args.batch, "seq": args.seq, "compile": args.compile,
           "ac": args.ac, "steps": args.steps, "steps_done": len(losses), "loss": losses,
           "tokens_per_s": args.batch * args.seq / (median_ms / 1e3), "peak_mb": peak_mb,
           # the steps' spread (a stall shows as p90 past p50) and the caching allocator's
           # retries (a cudaMalloc that failed, cache freed, tried again: it synchronizes)
           "step_ms": {q: steady[int(f * (len(steady) - 1))]
                       for q, f in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9))},
           "reserved_peak_mb": stats.get("reserved_bytes.all.peak", 0) / 2**20,
           "alloc_retries": stats.get("num_alloc_retries", 0),
           "data": f"{', '.join(texts)}: {tokens.numel()} tokens, vocab {vocab}"}
    if gpu_parts:  # --profile: the profiled steps' GPU time by part, ms a step
        row["gpu_ms_per_step"] = gpu_parts
    if memory_peak:  # --memory-step
        row["memory_peak"] = memory_peak
    import torchtitan

    path = result_file.write(f"torchtitan_{args.model.replace('-', '_')}", [row], KEY,
                             out=args.out, meta=result_file.run_meta(
                                 torchtitan=torchtitan.__version__))
    print(f"{path}: {row['impl']} seed {args.seed}, {len(losses)} steps, "
          f"{row['tokens_per_s']:,.0f} tokens/s, peak {peak_mb:,.0f} MiB")
    return 0 if len(losses) == args.steps else 2


GC_EVERY = 50  # torchtitan's training.gc_freq default
PROFILE_FROM = 20  # past compilation and the first steps' allocations


def peak_composition(snapshot: dict, base_bytes: int, top: int = 16) -> dict:
    """What one recorded step held at its peak: replays the allocator's trace (allocations
    and completed frees since recording began) from base_bytes, the bytes allocated before
    the step (frees of older blocks count too), and names the step's own allocations live at
    the highest point by the innermost Python frame outside torch (the line in mokgen,
    torchtitan or this file that asked). -> {"base_mb", "peak_mb", "step_mb_by_site":
    [[site, MiB], ...]}."""
    events = [ev for trace in snapshot.get("device_traces", []) for ev in trace
              if ev["action"] in ("alloc", "free_completed")]

    def replay(stop: int) -> tuple:
        live, now, peak, peak_at = {}, base_bytes, base_bytes, 0
        for i, ev in enumerate(events[:stop]):
            if ev["action"] == "alloc":
                live[ev["addr"]] = ev
                now += ev["size"]
            else:
                live.pop(ev["addr"], None)
                now -= ev["size"]
            if now > peak:
                peak, peak_at = now, i + 1
        return live, peak, peak_at

    _, peak, peak_at = replay(len(events))
    live, _, _ = replay(peak_at)
    by_site: dict = {}
    for ev in live.values():
        site = alloc_site(ev.get("frames", []))
        by_site[site] = by_site.get(site, 0) + ev["size"]
    ranked = sorted(by_site.items(), key=lambda kv: -kv[1])[:top]
    return {"base_mb": base_bytes / 2**20, "peak_mb": peak / 2**20,
            "step_mb_by_site": [[site, b / 2**20] for site, b in ranked]}


def alloc_site(frames: list) -> str:
    """The innermost frame not in torch itself, as file:line function (the first frame else)."""
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" not in name and not name.startswith("<") and name:
            return f"{os.path.basename(name)}:{f.get('line')} {f.get('name')}"
    return f"{frames[0].get('filename')}:{frames[0].get('line')}" if frames else "?"


def format_peak(peak: dict) -> str:
    lines = [f"memory at the recorded step's peak: {peak['peak_mb']:,.0f} MiB "
             f"({peak['base_mb']:,.0f} before the step; the step's live allocations by site:)"]
    lines += [f"  {mb:9,.1f} MiB  {site}" for site, mb in peak["step_mb_by_site"]]
    return "\n".join(lines)


def idle_gaps(kernels: list, top: int = 12) -> tuple:
    """kernels: (start, end, name) of GPU work on any stream, in us. -> (busy us, idle us
    between the first start and the last end, the `top` longest idle gaps as (us, the name
    of the work before, of the work after)): where the GPU waited for the host."""
    busy = idle = 0.0
    gaps, end, last = [], None, ""
    for start, stop, name in sorted(kernels):
        if end is not None and start > end:
            idle += start - end
            gaps.append((start - end, last, name))
        if end is None or stop > end:  # the part of this kernel past what ran before
            busy += stop - (start if end is None else max(start, end))
            end, last = stop, name
    return busy, idle, sorted(gaps, reverse=True)[:top]


# Where a step's GPU time goes, by kernel name: the parts that are the same whatever the MoE
# (AdamW's foreach kernels; FSDP2's parameter all-gather copies, bf16 casts and gradient
# reduce-scatter packing and scaling, which run even on one GPU) and mokgen's own kernels.
# What is left ("rest") is attention, the dense layers and, for torchtitan, its MoE.
GPU_PARTS = (("optimizer", ("multi_tensor_apply",)),
             ("fsdp_copies", ("Memcpy DtoD", "bfloat16_copy_kernel", "chunk_cat",
                              "BUnaryFunctor<float")),
             ("mokgen", ("mokgen_",)))


def gpu_time_by_part(kernels: list, steps: int) -> dict:
    """kernels: (start, end, name) in us -> ms a step of each GPU_PARTS part and the rest,
    summed over kernels (streams that overlap count twice)."""
    out = dict.fromkeys([p for p, _ in GPU_PARTS] + ["rest"], 0.0)
    for start, stop, name in kernels:
        part = next((p for p, keys in GPU_PARTS if any(k in name for k in keys)), "rest")
        out[part] += (stop - start) / 1e3 / steps
    return {k: round(v, 2) for k, v in out.items()}


def write_profile(prof, args, step_ms: list) -> dict:
    """The profiled steps' GPU kernels by total time and the GPU's idle gaps between them
    -> profile_<model>_<impl>.txt; returns their GPU time by part (gpu_time_by_part)."""
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40,
                                      max_name_column_width=90)
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
               if e.device_type.name == "CUDA"]
    busy, idle, gaps = idle_gaps(kernels)
    parts = gpu_time_by_part(kernels, len(step_ms))
    name = label(args.impl, args.dtype, args.cuda_graphs)
    head = (f"{args.model} {name}: {len(step_ms)} steps, "
            f"{', '.join(f'{t:.1f}' for t in step_ms)} ms (synced, profiler on); GPU busy "
            f"{busy / 1e3:.1f} ms, idle between kernels {idle / 1e3:.1f} ms; longest gaps:\n"
            + "\n".join(f"  {us / 1e3:8.2f} ms after {a[:60]} before {b[:60]}"
                        for us, a, b in gaps)
            + f"\nGPU ms a step by part: {parts}")
    # no "+" in the name: the device machine's transfer leaves such files behind
    path = os.path.join(args.out, f"profile_{args.model}_{name.replace('+', '-')}.txt")
    with open(path, "w") as f:
        f.write(head + "\n" + table)
    print(head + "\n" + "\n".join(table.splitlines()[:28]))
    return parts


# a row's identity in the results file: a rerun of the same run replaces it
KEY = ("model", "impl", "seed", "layers", "batch", "seq", "compile", "ac", "steps")


def label(impl: str, dtype: str, cuda_graphs: bool = False) -> str:
    return (impl if dtype == "bf16" else f"{impl}-{dtype}") + ("+graphs" if cuda_graphs else "")


def smooth(values: list, window: int) -> list:
    """Trailing moving average."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


# ---------------------------------------------------------------- report
OWN_NOISE = "torchtitan (each seed against the others)"  # band_check's entry of the noise


def band_check(rows: list, window: int) -> dict:
    """Per row not torchtitan's: the fraction of steps its smoothed loss lies within the range
    of torchtitan's seeds' smoothed losses (same configuration), and its worst distance
    outside; under OWN_NOISE the same of each torchtitan seed against the range of the other
    seeds (its least and greatest): the noise a curve of torchtitan's own shows, what a
    mokgen curve is judged against (three seeds' range holds a fourth run's curve only about
    half the time). {} where fewer than two seeds ran."""
    band = [r for r in rows if r["impl"] == "torchtitan"]
    if len(band) < 2:
        return {}
    n = min(len(r["loss"]) for r in rows)
    curves = [smooth(r["loss"][:n], window) for r in band]

    def against(c: list, others: list) -> tuple:
        lo = [min(o[i] for o in others) for i in range(n)]
        hi = [max(o[i] for o in others) for i in range(n)]
        return (sum(lo[i] <= c[i] <= hi[i] for i in range(n)) / n,
                max(max(lo[i] - c[i], c[i] - hi[i], 0.0) for i in range(n)))

    out = {}
    for r in rows:
        if r["impl"] != "torchtitan":
            inside, worst = against(smooth(r["loss"][:n], window), curves)
            out[f"{r['impl']} seed {r['seed']}"] = {
                "inside_fraction": inside, "worst_excursion": worst, "steps": n}
    if len(curves) >= 3:
        own = [against(c, curves[:i] + curves[i + 1:]) for i, c in enumerate(curves)]
        out[OWN_NOISE] = {
            "inside_fraction": [min(o[0] for o in own), max(o[0] for o in own)],
            "worst_excursion": [min(o[1] for o in own), max(o[1] for o in own)], "steps": n}
    return out


def base_impl(impl: str) -> str:
    """The run a variant is judged against: mokgen-fp8 / mokgen-mxfp8 against mokgen, any
    IMPL+graphs against IMPL (its CUDA graph)."""
    impl = impl.removesuffix("+graphs")
    return impl.split("-", 1)[0]


def variant_check(rows: list, window: int) -> dict:
    """Per variant row (base_impl differs from its impl) whose base ran with the same seed:
    its final loss (the smoothed curve's last point: the mean of the last `window` steps)
    relative to the base's, and the largest gap between the two smoothed curves over their
    common steps: issue-style "final loss within 0.5% relative, curves overlapping" for fp8
    against bf16, and the same for a CUDA-graph run against its eager twin."""
    runs = {(r["impl"], r["seed"]): r for r in rows}
    out = {}
    for (impl, seed), r in sorted(runs.items()):
        base = runs.get((base_impl(impl), seed))
        if base is None or base is r:
            continue
        n = min(len(r["loss"]), len(base["loss"]))
        a, b = smooth(r["loss"][:n], window), smooth(base["loss"][:n], window)
        out[f"{impl} seed {seed} against {base['impl']}"] = {
            "final_rel": (a[-1] - b[-1]) / b[-1],
            "max_gap": max(abs(x - y) for x, y in zip(a, b)), "steps": n}
    return out


def report(args) -> int:
    name = f"torchtitan_{args.model.replace('-', '_')}"
    path = os.path.join(args.results, f"{name}.json")
    if not os.path.exists(path):
        raise SystemExit(f"no {path}: run first (see --help)")
    with open(path) as f:
        data = json.load(f)
    groups: dict = {}  # one band per GPU kind and training configuration
    for r in data["rows"]:
        groups.setdefault(tuple(r.get(k) for k in ("gpu",) + KEY[3:]), []).append(r)
    for i, (key, rows) in enumerate(sorted(groups.items(), key=lambda kv: str(kv[0]))):
        rows.sort(key=lambda r: (r["impl"], r["seed"]))
        print(f"{key[0]}: {dict(zip(KEY[3:], key[1:]))}")
        for r in rows:
            print(f"  {r['impl']:>14} seed {r['seed']}: {r['tokens_per_s']:>10,.0f} tokens/s, "
                  f"peak {r['peak_mb']:>8,.0f} MiB, loss {r['loss'][0]:.3f} -> "
                  f"{r['loss'][-1]:.3f} ({r['steps_done']} steps), commit {r['commit']}")
            if "step_ms" in r:
                q = r["step_ms"]
                print(f"  {'':>14}   step p10/p50/p90 {q['p10']:.1f}/{q['p50']:.1f}/"
                      f"{q['p90']:.1f} ms, reserved {r['reserved_peak_mb']:,.0f} MiB, "
                      f"{r['alloc_retries']} allocator retries")
        for run_name, v in band_check(rows, args.smooth).items():
            if run_name == OWN_NOISE:
                (f0, f1), (w0, w1) = v["inside_fraction"], v["worst_excursion"]
                print(f"  {run_name}: inside {f0:.1%}-{f1:.1%} of {v['steps']} steps, worst "
                      f"{w0:.4f}-{w1:.4f} outside")
                continue
            print(f"  {run_name}: inside torchtitan's seed band {v['inside_fraction']:.1%} of "
                  f"{v['steps']} steps, worst {v['worst_excursion']:.4f} outside")
        for run_name, v in variant_check(rows, args.smooth).items():
            print(f"  {run_name}: final loss {v['final_rel']:+.2%} relative, curves at most "
                  f"{v['max_gap']:.4f} apart ({v['steps']} steps, {args.smooth}-step means)")
        suffix = "" if len(groups) == 1 else f"_{i}"
        plot(rows, args.model, os.path.join(args.results, f"{name}{suffix}.png"), args.smooth)
    return 0


def plot(rows: list, model: str, path: str, window: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"torchtitan": "tab:gray", "mokgen": "tab:red", "mokgen-fp8": "tab:green",
              "mokgen-mxfp8": "tab:blue"}
    for r in rows:
        ax.plot(smooth(r["loss"], window), color=colors.get(r["impl"]), lw=1,
                alpha=0.6 if r["impl"] == "torchtitan" else 1.0,
                label=f"{r['impl']} seed {r['seed']}: {r['tokens_per_s']:,.0f} tokens/s, "
                      f"{r['peak_mb'] / 1024:.1f} GiB")
    ax.set(xlabel="step", ylabel=f"training loss ({window}-step mean)",
           title=f"torchtitan {model} ({rows[0]['layers']} layers), {rows[0]['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


def prebuild(args) -> int:
    """The kernels of each model's MoE blocks (one plan a model and dtype: every block of a
    model has the same shape), as run's mokgen override will plan them."""
    from torchtitan.models.qwen3 import model_registry

    from mokgen.integrations.torchtitan import moe_plan
    from mokgen.pytorch.api import build_plans

    plans = []
    for name in args.models.split(","):
        cfg = model_registry(REGISTRY[name]).model
        moe = next(layer.moe for layer in cfg.layers if getattr(layer, "moe", None) is not None)
        plans += [moe_plan(moe, tokens_per_rank=args.batch * args.seq, dtype=dt)
                  for dt in args.dtypes.split(",")]
    bins = build_plans(plans)
    print(f"prebuild: {len(plans)} plans, {len(bins)} kernels")
    if args.pack:
        import prebuild as packer

        packer.write_pack(bins, args.pack)
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    return {"run": run, "report": report, "prebuild": prebuild}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
