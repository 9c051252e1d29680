"""How fast is expert parallelism across GPUs, against NCCL? One process per GPU:

    torchrun --nproc-per-node=R benchmarks/multigpu.py [--loads ep64,ep8] [--tokens 2048,4096]
        [--shapes kimi-k2.7,...] [--iters 20] [--no-naive] [--out DIR]

Loads. Each GPU carries the per-rank load of a preset's EP deployment: L = E/64 ("ep64") or
E/8 ("ep8") local experts (at least ceil(k/R), so a token's k routes fit), N tokens per rank,
so it receives N*k routed rows on average: the work of benchmarks/moe_layer.py's single-GPU
slices, now with real peers. The layer run has E' = R*L experts, so at R = 2 about half of
the routes stay on their own GPU (a real ep=64 deployment sends 63/64 off-rank); the NVLink
floor and GB/s below count the bytes that really cross.

Columns (slowest rank's median over --iters CUDA-event-timed calls; every rank builds the same
global inputs from one broadcast seed):
  mokgen         forward / training step (forward + backward megakernel, autograd) of the
                 compiled layer over symmetric-memory peers
  nccl_grouped   route, all_to_all of counts (host sync for the splits), rows and local expert
                 ids, torch._grouped_mm experts, all_to_all back, weighted sum
                 (mokgen.harness.ep_baseline); training step by autograd
  nccl_naive     the same with a per-expert loop
  floor          max(compute, NVLink): compute = dense cuBLAS GEMMs of the same FLOPs timed on
                 this GPU (training: 3x the forward's); NVLink = bytes this rank sends over the
                 link (its off-rank rows out in dispatch, the peers' rows back in combine;
                 twice that for training) / the link rate, both the nominal (mokgen.compiler.hardware)
                 and the rate an NCCL all_to_all reaches here (nvlink_gbps_measured); floor_*
                 uses the faster one (the lower floor)
  predicted      mokgen.harness.simulate's forward / backward time of the plan (the cost model)

Rows go into DIR/multigpu.json (rows per GPU kind and world size, benchmarks/result_file.py)
after every row, so a run cut short keeps what it measured. Compile the kernels ahead (nvcc,
no GPU): `python benchmarks/prebuild.py multigpu --world R` (this script's, fsdp_overlap.py's
and the multi-GPU tests'). NVLink multicast stays off. DeepEP's dispatch/combine on the same
loads: benchmarks/peers_deepep.py.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import mokgen  # noqa: E402
from mokgen import reference  # noqa: E402
from mokgen.compiler import hardware  # noqa: E402
from mokgen.harness.ep_baseline import EPBaseline, dist_exchange  # noqa: E402

import result_file  # noqa: E402

PRESETS = "kimi-k2.7,glm-5.2,qwen3.5-397b-a17b,deepseek-v4-pro"
LOADS = {"ep64": 64, "ep8": 8}


def load_shape(name: str, load: str, R: int) -> mokgen.MoEShape:
    """The layer R GPUs run so that each carries one rank's load of `name` at ep=LOADS[load]."""
    p = mokgen.shapes.get(name)
    L = max(p.num_experts // LOADS[load], -(-p.topk // R))
    return mokgen.MoEShape(R * L, p.hidden, p.intermediate, p.topk, p.shared_experts,
                           p.shared_intermediate, name=f"{name}-{load}")


def configs(shapes: str, loads: str, tokens: str, R: int) -> list:
    return [(name, load, int(n)) for name in shapes.split(",") for load in loads.split(",")
            for n in tokens.split(",")]


def plans(args, R: int) -> list:
    """Every plan the run compiles (benchmarks/prebuild.py multigpu builds them ahead)."""
    return [mokgen.plan(load_shape(name, load, R), ep=R, tokens_per_rank=n)
            for name, load, n in configs(args.shapes, args.loads, args.tokens, R)]


# ---------------------------------------------------------------------------- on the GPUs
def slowest_ms(fn, iters):
    """The median of this rank's timed runs (mokgen.harness.bench.time_ms), maxed over the ranks."""
    import torch.distributed as dist
    from mokgen.harness.bench import time_ms

    t = torch.tensor([time_ms(fn, iters, warmup=5)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def shared_seed() -> int:
    import torch.distributed as dist

    s = torch.randint(0, 2**31 - 1, (1,), device="cuda")
    dist.broadcast(s, 0)
    return int(s.item())


def measure_link_gbps(mib: int = 256) -> float:
    """Per-direction GB/s an NCCL all_to_all_single reaches: each rank sends `mib` MiB to
    every peer; bytes leaving this GPU / time, slowest rank."""
    import torch.distributed as dist

    R = dist.get_world_size()
    if R == 1:
        return 0.0
    per_peer = mib << 20
    src = torch.empty(R * per_peer // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = slowest_ms(lambda: dist.all_to_all_single(dst, src), 10)
    return (R - 1) * per_peer / (ms * 1e-3) / 1e9


def offrank_rows(experts, L: int, r: int, R: int) -> int:
    """Rows leaving this GPU in one forward (as many arrive): in dispatch, its own routes to
    other ranks' experts (peers pull them); in combine, the outputs of the other ranks'
    routes to its experts (pushed back to their owners). The largest rank's count."""
    import torch.distributed as dist

    owner = torch.div(experts, L, rounding_mode="floor")
    sent = (owner != r).sum()
    got = torch.zeros((), dtype=sent.dtype, device=sent.device)
    counts = torch.stack([(owner == c).sum() for c in range(R)])
    everyone = [torch.zeros_like(counts) for _ in range(R)]
    dist.all_gather(everyone, counts)
    for src in range(R):
        if src != r:
            got += everyone[src][r]
    out = (sent + got).float()
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return int(out.item())


def rank_inputs(shape, n):
    """This rank's (x, router logits, w1, w2, shared_w1, shared_w2) and its output gradient,
    from seeds rank 0 broadcasts: every implementation gets the same tensors."""
    import torch.distributed as dist
    from mokgen.harness.workloads import make_inputs

    R, r = dist.get_world_size(), dist.get_rank()
    inp = make_inputs(shape, R, n, seed=shared_seed())
    tensors = tuple(inp[k][r] for k in ("x", "router_logits", "w1", "w2")) + \
        (inp["shared_w1"], inp["shared_w2"])
    dy = torch.randn(tensors[0].shape, device="cuda", generator=torch.Generator(device="cuda")
                     .manual_seed(shared_seed() + r)).bfloat16()
    return tensors, dy


def train_step(leaves, dy, fn):
    """One training step of fn(*leaves) as a callable: the leaves' grads cleared, forward,
    backward from dy."""
    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(dy)
    return run


def bench(name, load, n, iters, link_gbps, naive=True):
    import torch.distributed as dist
    from mokgen.harness.bench import dense_floor
    from mokgen.harness.simulate import predict_plan
    from mokgen.harness.workloads import rel_error

    R, r = dist.get_world_size(), dist.get_rank()
    shape = load_shape(name, load, R)
    L = shape.num_experts // R
    (x, z, w1, w2, sw1, sw2), dy = rank_inputs(shape, n)
    layer = mokgen.compile(shape, ep=R, tokens_per_rank=n, group=dist.group.WORLD)
    leaves = [t.detach().requires_grad_() for t in (x, z, w1, w2, sw1, sw2)]
    res = dict(shape=name, load=load, experts=shape.num_experts, local_experts=L, ep=R,
               tokens=n, hidden=shape.hidden, intermediate=shape.intermediate,
               topk=shape.topk, flops=shape.forward_flops(n),
               plan=dict(comm_sms_fwd=layer.plan.comm_sms_fwd,
                         comm_sms_bwd=layer.plan.comm_sms_bwd,
                         minibatch=layer.plan.minibatch, macrobatch=layer.plan.macrobatch))
    with torch.no_grad():
        res["mokgen_fwd_ms"] = slowest_ms(lambda: layer(x, z, w1, w2, sw1, sw2), iters)

    def step(fn):
        return train_step(leaves, dy, fn)
    res["mokgen_train_ms"] = slowest_ms(step(layer), iters)
    mine = {k: leaves[i].grad.clone() for i, k in enumerate(("x", "z", "w1"))}
    ex = dist_exchange()
    impls = (("grouped", True), ("naive", False)) if naive else (("grouped", True),)
    for label, grouped in impls:
        base = EPBaseline(shape, R, *leaves[2:], exchange=ex, grouped=grouped)
        with torch.no_grad():
            res[f"nccl_{label}_fwd_ms"] = slowest_ms(lambda: base(x, z), iters)
        res[f"nccl_{label}_train_ms"] = slowest_ms(
            step(lambda x_, z_, *_: base(x_, z_)), iters)
    # correctness against the baseline (grouped: the leaves' grads of its last step)
    base = EPBaseline(shape, R, *leaves[2:], exchange=ex)
    step(lambda x_, z_, *_: base(x_, z_))()
    with torch.no_grad():
        want, ours = base(x, z), layer(x, z, w1, w2, sw1, sw2)
    res["err_vs_nccl"] = rel_error(ours, want)
    for i, k in enumerate(("x", "z", "w1")):
        res[f"err_d{k}_vs_nccl"] = rel_error(mine[k], leaves[i].grad)
    # floors
    rows_off = offrank_rows(reference.route(z, shape.topk)[0], L, r, R)
    res["offrank_rows"] = rows_off
    res["link_bytes_fwd"] = rows_off * shape.hidden * 2  # bf16 rows, per direction
    res["floor_compute_fwd_ms"] = slowest_ms(dense_floor(shape, n, "cuda", torch.Generator(
        device="cuda").manual_seed(0)), iters)
    res["floor_compute_train_ms"] = 3 * res["floor_compute_fwd_ms"]
    gpu = hardware.default()  # the GPU in hand's nominal NVLink rate
    best_bw = max(gpu.nvlink_bw, link_gbps * 1e9)
    for kind, mult in (("fwd", 1), ("train", 2)):
        link_ms = 1e3 * mult * res["link_bytes_fwd"] / best_bw
        res[f"floor_link_{kind}_ms"] = link_ms
        res[f"floor_{kind}_ms"] = max(res[f"floor_compute_{kind}_ms"], link_ms)
    res["nvlink_gbps_fwd"] = res["link_bytes_fwd"] / res["mokgen_fwd_ms"] / 1e6
    pred = predict_plan(layer.plan, "h200-nvl8")
    res["predicted_fwd_ms"], res["predicted_bwd_ms"] = pred["fwd_ms"], pred["bwd_ms"]
    res["predicted_train_ms"] = pred["fwd_ms"] + pred["bwd_ms"]
    return res


def meta(**extra) -> dict:
    """The run's versions, its world size and NCCL's."""
    import torch.distributed as dist

    return result_file.run_meta(world=dist.get_world_size(), nccl=str(torch.cuda.nccl.version()),
                                **extra)


def table(rows) -> str:
    head = (f"{'shape':<18}{'load':>5}{'L':>4}{'N':>6}  ms: fwd mokgen nccl floor x  | "
            f"train mokgen nccl floor x  | GB/s  pred fwd/bwd")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['shape']:<18}{r['load']:>5}{r['local_experts']:>4}{r['tokens']:>6}  "
            f"{r['mokgen_fwd_ms']:7.3f} {r['nccl_grouped_fwd_ms']:7.3f} {r['floor_fwd_ms']:6.3f} "
            f"{r['nccl_grouped_fwd_ms'] / r['mokgen_fwd_ms']:4.2f} | "
            f"{r['mokgen_train_ms']:7.3f} {r['nccl_grouped_train_ms']:7.3f} "
            f"{r['floor_train_ms']:6.3f} {r['nccl_grouped_train_ms'] / r['mokgen_train_ms']:4.2f}"
            f" | {r['nvlink_gbps_fwd']:5.0f}  {r['predicted_fwd_ms']:.3f}/"
            f"{r['predicted_bwd_ms']:.3f}")
    return "\n".join(lines)


def parse(argv=None, name: str = "multigpu", description: str = __doc__):
    """The arguments of this script, and of peers_deepep.py (`name`: its results file)."""
    ap = argparse.ArgumentParser(description=description.split("\n")[0])
    ap.add_argument("--shapes", default=PRESETS, help="comma list of presets (default: %(default)s)")
    ap.add_argument("--loads", default="ep64,ep8", help="comma list of ep64, ep8")
    ap.add_argument("--tokens", default="2048,4096", help="comma list of tokens per rank")
    ap.add_argument("--iters", type=int, default=20, help="timed calls a measurement")
    ap.add_argument("--no-naive", action="store_true", help="skip the per-expert-loop baseline")
    ap.add_argument("--out", default=result_file.RESULTS,
                    help=f"folder of {name}.json (default: %(default)s)")
    args = ap.parse_args(argv)
    for load in args.loads.split(","):
        if load not in LOADS:
            ap.error(f"--loads: unknown load {load!r}; known: {', '.join(LOADS)}")
    return args


def init_dist():
    import torch.distributed as dist

    for k, v in (("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NCCL_NVLS_ENABLE", "0"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))


KEY = ("world", "shape", "load", "tokens")


def main(argv=None):
    import torch.distributed as dist

    args = parse(argv)
    init_dist()
    R = dist.get_world_size()
    link = measure_link_gbps()
    rows, path = [], None
    for name, load, n in configs(args.shapes, args.loads, args.tokens, R):
        rows.append(bench(name, load, n, args.iters, link, naive=not args.no_naive))
        rows[-1].update(world=R, nvlink_gbps_measured=link)
        if dist.get_rank() == 0:  # written after every row: a cut-short run keeps its rows
            print(json.dumps(rows[-1]), flush=True)
            path = result_file.write("multigpu", rows[-1:], KEY, out=args.out,
                                     meta=meta(nvlink_gbps_measured=link))
        gc.collect()
        torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        print(f"wrote {path}; NCCL all_to_all reaches {link:.0f} GB/s per direction")
        print(table(rows))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
