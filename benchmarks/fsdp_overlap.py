"""Does an FSDP-style all-gather overlap the MoE layer? One process per GPU:

    torchrun --nproc-per-node=R benchmarks/fsdp_overlap.py [--shape kimi-k2.7] [--load ep64]
        [--tokens 4096] [--gather-mib 256] [--reserves 0,16] [--iters 20] [--trace] [--out DIR]

FSDP/HSDP shard the dense weights and all-gather them while the previous layer computes. The
persistent megakernels hold every SM, so such a gather waits for them. For each reserve (0:
every SM to the layer; the default's second: what `overlap_comm=True` plans) and for the
forward and the training step (forward + backward) of one rank's load (benchmarks/
multigpu.py's loads):
  layer_ms    the layer's call alone
  gather_ms   all_gather_into_tensor of --gather-mib MiB per rank alone, on a side stream
  overlap_ms  the gather issued on the side stream just before the layer call, until both end
  target_ms   layer_ms + 0.15 * gather_ms (the gather 85% hidden); and
              target_vs_reserve0_ms, the same from the layer's time with every SM
  hidden      (layer_ms + gather_ms - overlap_ms) / gather_ms: the share of the gather hidden
  *_gpu_*     the same with each run's launches queued behind a GPU sleep: the GPU's time
              alone, as in a training loop whose host runs ahead (the event times above
              include the host's ~1 ms to a training call's first kernel and the ranks' skew)
The gather runs on its own process group whose NCCL config caps its CTAs at the reserve
(`ProcessGroupNCCL.Options().config.max_ctas`; reserve 0: NCCL's default), as a user running
`overlap_comm=True` would set it. Slowest rank's median over --iters calls. Rows go into
DIR/fsdp_overlap.json (rows per GPU kind and world size, benchmarks/result_file.py). Kernels
ahead: `python benchmarks/prebuild.py multigpu --world R`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mokgen  # noqa: E402
from mokgen.compiler import hardware  # noqa: E402
from mokgen.harness.bench import short_kernel_name, time_ms  # noqa: E402
from mokgen.compiler.passes.sm_partition import collective_sms  # noqa: E402
from multigpu import init_dist, load_shape, meta, shared_seed  # noqa: E402

import result_file  # noqa: E402

KEY = ("world", "shape", "load", "tokens", "gather_mib", "reserve_sms", "mode")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="kimi-k2.7", help="preset (default: %(default)s)")
    ap.add_argument("--load", default="ep64", help="ep64 or ep8 (benchmarks/multigpu.py)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--gather-mib", type=int, default=256, help="MiB each rank gathers")
    # overlap_comm's reserve on the GPU in hand
    ap.add_argument("--reserves", default=f"0,{collective_sms(hardware.default())}",
                    help="comma list of reserve_sms (0: none; the default: overlap_comm's)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls a measurement")
    ap.add_argument("--trace", action="store_true",
                    help="also print both ranks' kernels and long host calls (start, "
                         "duration) of one overlapped call per reserve and mode, from "
                         "torch.profiler (timeline)")
    ap.add_argument("--out", default=result_file.RESULTS,
                    help="folder of fsdp_overlap.json (default: %(default)s)")
    return ap.parse_args(argv)


def reserves(args) -> list:
    return [int(v) for v in args.reserves.split(",")]


def plans(args, R: int) -> list:
    """Every plan the run compiles (benchmarks/prebuild.py builds them ahead)."""
    shape = load_shape(args.shape, args.load, R)
    return [mokgen.plan(shape, ep=R, tokens_per_rank=args.tokens, **over(v))
            for v in reserves(args)]


def over(reserve: int) -> dict:
    return dict(reserve_sms=reserve) if reserve else {}


def gather_group(max_ctas: int):
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    if max_ctas:
        opts.config.max_ctas = max_ctas
    return dist.new_group(list(range(dist.get_world_size())), pg_options=opts)


def timed(fn, iters: int, queue_ahead: bool = False) -> float:
    """Median ms of fn() between two events on the current stream (fn joins its side work
    back into it; mokgen.harness.bench.time_ms), each run started by all ranks together (a gather is
    as fast as its slowest rank), maxed over the ranks. queue_ahead: the GPU's time alone,
    fn's launches queued behind a GPU sleep (a training loop's host runs ahead of its GPU;
    here each run starts from an idle GPU, and the host's time to the first kernel, ~1 ms
    for a training call, and the ranks' host skew, up to 0.6 ms, land in the event time)."""
    import torch.distributed as dist

    def together():
        dist.barrier()
        torch.cuda.synchronize()

    t = torch.tensor([time_ms(fn, iters, warmup=3, setup=together, queue_ahead=queue_ahead)],
                     device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timeline(title: str, fn) -> None:
    """Every rank runs fn() once under torch.profiler (the collective needs them all); rank 0
    prints both ranks' kernels and their host calls that took over 50 us, by start on the
    host's clock (one clock for the processes of one machine), from rank 0's start of fn():
    when one rank waits in mokgen_barrier, the other's rows say what kept it."""
    import tempfile

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dist.barrier()  # inside: the profiler's own start skews the ranks otherwise
        torch.cuda.synchronize()
        with record_function("overlapped_call"):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            evs = json.load(g)["traceEvents"]
    start = [e["ts"] for e in evs if e.get("name") == "overlapped_call"]
    rows = [(e["ts"], dist.get_rank(), e.get("cat"), e.get("args", {}).get("stream", ""),
             e["dur"], e["name"]) for e in evs
            if e.get("ph") == "X" and (e.get("cat") == "kernel" or (
                e.get("cat") in ("cuda_runtime", "cuda_driver") and e["dur"] > 50))
            and start and e["ts"] >= start[0]]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (start[0] if start else 0.0, rows))
    if dist.get_rank() != 0:
        return
    t0 = every[0][0]
    print(f"-- {title}: rank, stream (or host), start us, duration us; ranks start "
          + ", ".join(f"{s - t0:+.0f}" for s, _ in every))
    for ts, r, cat, stream, dur, name in sorted(x for _, rs in every for x in rs):
        where = f"s{stream}" if cat == "kernel" else "host"
        print(f"  r{r} {where:<5} {ts - t0:9.1f} {dur:9.1f}  {short_kernel_name(name)[:56]}")


def run(args, reserve: int, inputs, gather_mib: int) -> list:
    import torch.distributed as dist

    R = dist.get_world_size()
    shape = load_shape(args.shape, args.load, R)
    layer = mokgen.compile(shape, ep=R, tokens_per_rank=args.tokens, group=dist.group.WORLD,
                           **over(reserve))
    x, z, w1, w2, sw1, sw2, dy = inputs
    leaves = [t.detach().requires_grad_() for t in (x, z, w1, w2, sw1, sw2)]
    gg, side = gather_group(reserve), torch.cuda.Stream()
    numel = (gather_mib << 20) // 2
    shard = torch.randn(numel, device="cuda").bfloat16()
    full = torch.empty(R * numel, dtype=torch.bfloat16, device="cuda")

    def fwd():
        with torch.no_grad():
            layer(x, z, w1, w2, sw1, sw2)

    def train():
        for t in leaves:
            t.grad = None
        layer(*leaves).backward(dy)

    def gather():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_gather_into_tensor(full, shard, group=gg)

    def join():
        torch.cuda.current_stream().wait_stream(side)

    rows = []
    gather_ms = timed(lambda: (gather(), join()), args.iters)
    gather_gpu_ms = timed(lambda: (gather(), join()), args.iters, queue_ahead=True)
    for mode, call in (("fwd", fwd), ("train", train)):
        r = dict(reserve_sms=reserve, mode=mode, num_sms=layer.plan.num_sms,
                 comm_sms_fwd=layer.plan.comm_sms_fwd, comm_sms_bwd=layer.plan.comm_sms_bwd,
                 minibatch=layer.plan.minibatch, gather_mib=gather_mib,
                 nccl_max_ctas=reserve or None, gather_ms=gather_ms)
        r["layer_ms"] = timed(call, args.iters)
        r["overlap_ms"] = timed(lambda: (gather(), call(), join()), args.iters)
        r["target_ms"] = r["layer_ms"] + 0.15 * gather_ms
        r["hidden"] = (r["layer_ms"] + gather_ms - r["overlap_ms"]) / gather_ms
        r["gather_gpu_ms"] = gather_gpu_ms
        r["layer_gpu_ms"] = timed(call, args.iters, queue_ahead=True)
        r["overlap_gpu_ms"] = timed(lambda: (gather(), call(), join()), args.iters,
                                    queue_ahead=True)
        r["target_gpu_ms"] = r["layer_gpu_ms"] + 0.15 * gather_gpu_ms
        r["hidden_gpu"] = (r["layer_gpu_ms"] + gather_gpu_ms - r["overlap_gpu_ms"]) \
            / gather_gpu_ms
        if args.trace:
            timeline(f"reserve {reserve} {mode}", lambda: (gather(), call(), join()))
        r["gather_gbps"] = (R - 1) * (gather_mib << 20) / (gather_ms * 1e-3) / 1e9
        rows.append(r)
    layer.synchronize()  # a watchdog record, if any, raises here
    dist.destroy_process_group(gg)
    return rows


def main(argv=None):
    import torch.distributed as dist

    args = parse(argv)
    init_dist()
    R, rank = dist.get_world_size(), dist.get_rank()
    shape = load_shape(args.shape, args.load, R)
    from mokgen.harness.workloads import make_inputs

    inp = make_inputs(shape, R, args.tokens, seed=shared_seed())
    dy = torch.randn(inp["x"][rank].shape, device="cuda").bfloat16()
    inputs = (inp["x"][rank], inp["router_logits"][rank], inp["w1"][rank], inp["w2"][rank],
              inp["shared_w1"], inp["shared_w2"], dy)
    del inp
    rows = []
    for reserve in reserves(args):
        rows += run(args, reserve, inputs, args.gather_mib)
        if rank == 0:
            print(json.dumps(rows[-2]), json.dumps(rows[-1]), sep="\n", flush=True)
    full = {r["mode"]: (r["layer_ms"], r["layer_gpu_ms"]) for r in rows
            if r["reserve_sms"] == 0}
    for r in rows:  # the stricter reading: against the layer with every SM
        if r["mode"] in full:
            r["target_vs_reserve0_ms"] = full[r["mode"]][0] + 0.15 * r["gather_ms"]
            r["target_gpu_vs_reserve0_ms"] = full[r["mode"]][1] + 0.15 * r["gather_gpu_ms"]
    if rank == 0:
        where = dict(world=R, shape=args.shape, load=args.load,
                     local_experts=shape.num_experts // R, tokens=args.tokens)
        path = result_file.write("fsdp_overlap", [dict(where, **r) for r in rows], KEY,
                                 out=args.out, meta=meta())
        print(f"wrote {path}")
        print(f"ms; {args.shape} {args.load} N={args.tokens}, {args.gather_mib} MiB gather; "
              f"event time (host gaps in) | GPU time (launches queued ahead); target0: "
              f"against the layer with every SM")
        print(f"{'reserve':>7} {'mode':>5} {'layer':>7} {'gather':>7} {'overlap':>7} "
              f"{'target':>7} {'hidden':>6} | {'layer':>7} {'gather':>7} {'overlap':>7} "
              f"{'target':>7} {'target0':>7} {'hidden':>6}")
        for r in rows:
            print(f"{r['reserve_sms']:>7} {r['mode']:>5} {r['layer_ms']:7.3f} "
                  f"{r['gather_ms']:7.3f} {r['overlap_ms']:7.3f} {r['target_ms']:7.3f} "
                  f"{r['hidden']:6.2f} | {r['layer_gpu_ms']:7.3f} {r['gather_gpu_ms']:7.3f} "
                  f"{r['overlap_gpu_ms']:7.3f} {r['target_gpu_ms']:7.3f} "
                  f"{r.get('target_gpu_vs_reserve0_ms', float('nan')):7.3f} "
                  f"{r['hidden_gpu']:6.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
