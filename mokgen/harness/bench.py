"""Per-rank slice of an EP deployment on one GPU: mokgen vs PyTorch baselines and the floor.

All ranks' inputs and routes are made on the GPU. The timed region is rank 0's whole forward:
route its tokens, build its schedule, pull the rows routed to its experts from every rank,
run shared + routed experts, push outputs to the owners, sum its own k rows per token.
Baselines get the same tensors and do the same work:
  naive   per-expert Python loop (index gather, two matmuls, index_add) - syncs on counts
  grouped torch._grouped_mm pipeline (argsort by expert, gather, grouped GEMMs, scatter)
  floor   dense cuBLAS GEMMs of the same FLOPs (no routing, no data movement)
Effective TFLOP/s = 6 N (k+1) D I / t; medians of >= 50 timed runs after warm-up.
Only rank 0's expert weights exist (the other ranks' megakernels never run in the timed
region), so EP=64 slices fit on one GPU.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import mokgen

from mokgen import reference
from mokgen.config import CONFIG
from mokgen.harness.progress import progress
from mokgen.harness.workloads import rel_error


QUEUE_AHEAD_CYCLES = 20_000_000  # ~10 ms of GPU sleep: longer than a call's host work


def time_ms(fn, iters: int, warmup: int = 10, setup=None, queue_ahead: bool = False,
            sleep_cycles: int = QUEUE_AHEAD_CYCLES) -> float:
    """Median ms of fn() over iters CUDA-event-timed runs; setup() (untimed) before each.
    queue_ahead: a GPU sleep of `sleep_cycles` is queued before each timed run, so the host
    has queued fn's launches before the GPU reaches them: the GPU's time alone, without the
    host's launch gaps (which decide small calls' times and vary from run to run; for
    comparing kernels whose host work is the same). A run whose host work outlasts the
    sleep (several layers' steps) needs a longer one; one that waits on the GPU inside
    (a host sync) gets its gaps back whatever the sleep."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    times = []
    for _ in range(iters):
        if setup:
            setup()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queue_ahead:
            torch.cuda._sleep(sleep_cycles)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def sustained_ms(fn, seconds: float, settle: float = 0.2, batch: int = 5) -> float:
    """ms a call of fn() run back to back for `seconds` (a sync every `batch` calls), over the
    calls after the first `settle` seconds: the rate a training loop holds once the board's
    power cap has set the clock. time_ms's synced calls leave the GPU idle between them, and
    a few dozen of them can end before the cap bites (a standalone GEMM up to 20% faster
    that way)."""
    torch.cuda.synchronize()
    t0 = time.time()
    settled, calls = None, 0  # calls completed since `settled`
    while time.time() - t0 < seconds:
        for _ in range(batch):
            fn()
        torch.cuda.synchronize()
        if settled is not None:
            calls += batch
        elif time.time() - t0 >= settle:
            settled = time.time()
    if not calls:
        raise ValueError(f"no call completed in the {seconds - settle:.2f} s after settling")
    return (time.time() - settled) * 1e3 / calls


def short_kernel_name(name: str) -> str:
    """A kernel's name for a table or a log line, in 72 characters: its head and its tail
    (kernel_times keeps names whole; a CuTe DSL name's tail says which GEMM it is, a
    templated PyTorch kernel's head says which op)."""
    return name if len(name) <= 72 else f"{name[:33]}..{name[-37:]}"


def kernel_times(setup, run):
    """The GPU kernels (and memsets / copies) of one run() after setup(), from torch.profiler:
    [(name, start us from the first, duration us)]: what an event time holds besides the
    megakernel (its launch, the prologue's kernels, the combine). Names are whole: what tells
    CuTe DSL's GEMMs apart (operand majors, epilogue) sits far into them; short_kernel_name
    prints them."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    setup()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    t0 = evs[0].time_range.start if evs else 0
    return [(e.name, round(e.time_range.start - t0, 1),
             round(e.time_range.end - e.time_range.start, 1)) for e in evs]


def own_combine_rows(rt, mine: torch.Tensor) -> torch.Tensor:
    """The rows rank 0's experts pushed to rank 0's own combine buffer, `mine` a mask over
    its n k routes. The buffer may hold more rows than that: at ep 1 in bf16 it is also the
    backward's dy ring, sized for the padded ring layout (runtime/peers.py combine_rows)."""
    return rt.peers.bufs["combine"][0][:mine.numel()][mine]


def make_slice(shape, ep, n, g):
    E, D, I, L = shape.num_experts, shape.hidden, shape.intermediate, shape.num_experts // ep
    dev = "cuda"
    rn = lambda *s: torch.randn(*s, generator=g, device=dev)  # noqa: E731
    xs = [rn(n, D).bfloat16() for _ in range(ep)]
    zs = [rn(n, E) for _ in range(ep)]
    w1 = (rn(L, 2 * I, D) / D**0.5).bfloat16()
    w2 = (rn(L, D, I) / I**0.5).bfloat16()
    if not shape.shared_experts:
        return xs, zs, w1, w2, None, None
    sw1 = (rn(2 * shape.shared_dim, D) / D**0.5).bfloat16()
    sw2 = (rn(D, shape.shared_dim) / shape.shared_dim**0.5).bfloat16()
    return xs, zs, w1, w2, sw1, sw2


class TorchSlice:
    """Rank 0's work in PyTorch: the rows routed to its L experts from every rank."""

    def __init__(self, shape, ep, xs, zs, w1, w2, sw1, sw2, grad=False):
        self.shape, self.ep, self.k = shape, ep, shape.topk
        self.L = shape.num_experts // ep
        self.X = torch.stack(xs)            # [R, n, D]: peers' tokens (read = dispatch)
        self.zs, self.w1, self.w2, self.sw1, self.sw2 = zs, w1, w2, sw1, sw2
        if grad:  # training: autograd leaves (the baselines' backward is autograd's)
            for name in ("X", "w1", "w2", "sw1", "sw2"):
                if getattr(self, name) is not None:
                    setattr(self, name, getattr(self, name).detach().requires_grad_())

    def _routes(self, all_routes):
        """Rank 0 routes its own tokens (timed); the other ranks' routes were all-gathered
        earlier. Returns the flat [R*n*k] global expert of every route."""
        flat = all_routes.clone()
        flat[0] = reference.route(self.zs[0], self.k)[0].flatten()
        return flat.flatten()

    def shared(self, x):
        if self.sw1 is None:  # no shared expert
            return torch.zeros_like(x)
        return reference.expert_ffn(x, self.sw1, self.sw2)

    def grouped(self, all_routes, all_weights):
        """-> (y, combine, owner0, scratch, idx): see _push_and_sum."""
        n, D = self.X.shape[1], self.X.shape[2]
        local = self._routes(all_routes)
        mask = local < self.L                     # rank 0 owns experts 0..L-1
        idx = mask.nonzero().squeeze(1)           # [P]: one host sync for the size
        order = torch.argsort(local[idx], stable=True)
        idx = idx[order]
        rows = self.X.view(-1, D)[idx // self.k]  # pull dispatch
        counts = torch.bincount(local[idx], minlength=self.L)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = torch._grouped_mm(rows, self.w1.transpose(1, 2), offs=offs)
        I = h.shape[1] // 2
        a = F.silu(h[:, :I]) * h[:, I:]
        out = torch._grouped_mm(a, self.w2.transpose(1, 2), offs=offs)
        wts = all_weights.flatten()[idx]
        out = out * wts[:, None].to(out.dtype)
        return self._push_and_sum(idx, out, n, D)

    def train_step(self, kind, all_routes, all_weights, dY):
        """(setup, backward) of one training step through pipeline `kind` ("grouped" or
        "naive"): setup runs the forward with autograd; backward pulls every computed row's
        upstream gradient (rank 0's own dy for its tokens, the other owners' dy rows for the
        rows it pushed to them) and runs autograd's backward."""
        state = {}

        def setup():
            state["out"] = getattr(self, kind)(all_routes, all_weights)

        def backward():
            y, _, owner0, scratch, idx = state.pop("out")
            d_other = dY.view(-1, dY.shape[-1])[idx[~owner0] // self.k]
            torch.autograd.backward([y, scratch], [dY[0], d_other])
        return setup, backward

    def _push_and_sum(self, idx, out, n, D):
        """Push every output row to its owner (rows of other owners go to a scratch of the
        same size: the same bytes move), then rank 0 sums its own k rows per token."""
        owner0 = idx < n * self.k
        combine = torch.zeros(n * self.k, D, device=out.device, dtype=out.dtype)
        combine = combine.index_copy(0, idx[owner0], out[owner0])
        scratch = out[~owner0]  # rows pushed to the other owners (a copy: the same bytes)
        y = self.shared(self.X[0]) + combine.view(n, self.k, D).sum(1)
        return y, combine, owner0, scratch, idx

    def naive(self, all_routes, all_weights):
        """The same result as grouped, through a per-expert loop."""
        n, D = self.X.shape[1], self.X.shape[2]
        local = self._routes(all_routes)
        outs, idxs = [], []
        for e in range(self.L):
            idx = (local == e).nonzero().squeeze(1)
            if len(idx) == 0:
                continue
            rows = self.X.view(-1, D)[idx // self.k]
            out = reference.expert_ffn(rows, self.w1[e], self.w2[e])
            outs.append(out * all_weights.flatten()[idx, None].to(out.dtype))
            idxs.append(idx)
        return self._push_and_sum(torch.cat(idxs), torch.cat(outs), n, D)


def dense_floor(shape, n, dev, g):
    D, I, k, IS = shape.hidden, shape.intermediate, shape.topk, shape.shared_dim
    a = torch.randn(n * k, D, device=dev, generator=g).bfloat16()
    b = torch.randn(D, 2 * I, device=dev, generator=g).bfloat16()
    c = torch.randn(n * k, I, device=dev, generator=g).bfloat16()
    d = torch.randn(I, D, device=dev, generator=g).bfloat16()
    sa, sb = a[:n], torch.randn(D, 2 * IS, device=dev, generator=g).bfloat16()
    sc = torch.randn(n, IS, device=dev, generator=g).bfloat16()  # IS may exceed I
    sd = torch.randn(IS, D, device=dev, generator=g).bfloat16()
    return lambda: (a @ b, c @ d, sa @ sb, sc @ sd)


def bench_one(name, ep, n, iters, g, backward=False, naive=True, queue_ahead=False,
              sustained=0.0, **overrides):
    """`name`: a preset's name, or a MoEShape (reported by its name). naive=False skips the
    per-expert loop baseline (slow at hundreds of local experts; its columns are then NaN).
    queue_ahead: every timing is the GPU's alone (time_ms). sustained > 0 (with backward):
    also both training steps (forward + backward) back to back for that many seconds each,
    at the power cap (sustained_ms): the backward's `mokgen_train_sustained_ms` and
    `grouped_train_sustained_ms`."""
    timed = functools.partial(time_ms, queue_ahead=queue_ahead)
    shape = name if isinstance(name, mokgen.MoEShape) else mokgen.shapes.get(name)
    name = shape.name or str(shape) if isinstance(name, mokgen.MoEShape) else name
    xs, zs, w1, w2, sw1, sw2 = make_slice(shape, ep, n, g)
    layer = mokgen.compile(shape, ep=ep, tokens_per_rank=n, virtual=True, **overrides)
    rt = layer.runtime()
    inputs = dict(x=xs, router_logits=zs, w1=[w1] * ep, w2=[w2] * ep, shared_w1=sw1,
                  shared_w2=sw2)
    layer(**inputs)  # full call: every rank's routes + combine rows exist
    all_routes = rt.peers.bufs["routes"][0].long()        # gathered [R, n*k], from mokgen
    all_weights = rt.peers.bufs["weights"][0]
    args = (xs, zs, [w1] * ep, [w2] * ep, sw1, sw2)
    ours = lambda: rt.forward_rank(0, *args)  # noqa: E731
    ts = TorchSlice(shape, ep, xs, zs, w1, w2, sw1, sw2)
    ours()
    mine = all_routes[0] < ts.L  # rank 0's routes to rank 0's own experts
    res = dict(shape=name, ep=ep, tokens=n, flops=shape.forward_flops(n))
    # rows rank 0's experts pushed to rank 0's own combine buffer, both implementations
    res["err_vs_grouped"] = rel_error(own_combine_rows(rt, mine),
                                      ts.grouped(all_routes, all_weights)[1][mine])
    res["mokgen_ms"] = timed(ours, iters)
    b0, xp = rt.ranks[0], rt.peer_rows(xs)

    def mega():
        b0.counters.zero_()
        rt.experts(0, xs[0], xp, w1, w2, sw1, sw2)
    res["stage_ms"] = dict(
        route_schedule=timed(lambda: (rt.route(0, zs[0], n), rt.schedule(0, n)), iters),
        megakernel=timed(mega, iters), combine_sum=timed(lambda: rt.combine_sum(0, n), iters))
    res["grouped_ms"] = timed(lambda: ts.grouped(all_routes, all_weights), iters)
    res["naive_ms"] = timed(lambda: ts.naive(all_routes, all_weights), max(10, iters // 5)) \
        if naive else float("nan")
    res["floor_ms"] = timed(dense_floor(shape, n, "cuda", g), iters)
    for k in ("mokgen", "grouped", "naive", "floor"):
        res[f"{k}_tflops"] = res["flops"] / res[f"{k}_ms"] / 1e9
    res["plan"] = dict(minibatch=layer.plan.minibatch, macrobatch=layer.plan.macrobatch,
                       comm_sms=layer.plan.comm_sms_fwd)
    if backward:
        res["backward"] = bench_backward(layer, shape, args, res["floor_ms"], iters, g, naive,
                                         queue_ahead, sustained)
    return res  # the slice's tensors die with this frame; main() frees the cache


class TrainingSteps:
    """Rank 0's training step both ways, on the same inputs and output gradient: ours (`fwd`,
    its forward saving what the backward reads; `bwd`, its backward) and autograd through
    torch._grouped_mm (`setup`, its forward; `back`, its backward). `tg` holds the baseline's
    autograd leaves, `dY` the output gradient (every rank's), `routes` / `weights` the
    gathered routes and router weights, as the layer computed them."""

    def __init__(self, layer, shape, args, g):
        xs, zs, w1s, w2s, sw1, sw2 = args
        rt, bwd = layer.runtime(), layer.backward_runtime()
        dys = [torch.randn(x.shape, device=x.device, generator=g).bfloat16() for x in xs]
        # a full call first: every rank's routes, rings and pushed rows exist
        layer(x=xs, router_logits=zs, w1=w1s, w2=w2s, shared_w1=sw1, shared_w2=sw2)
        self.routes = rt.peers.bufs["routes"][0].long()  # gathered [R, n*k]
        self.weights = rt.peers.bufs["weights"][0]
        self.fwd = lambda: rt.forward_rank(0, *args, save=True)
        self.bwd = lambda: bwd.backward_rank(0, dys, xs, w1s, w2s, sw1, sw2)
        self.tg = TorchSlice(shape, len(xs), xs, zs, w1s[0], w2s[0], sw1, sw2, grad=True)
        self.dY = torch.stack(dys)
        self.setup, self.back = self.tg.train_step("grouped", self.routes, self.weights, self.dY)


def bench_backward(layer, shape, args, fwd_floor_ms, iters, g, naive=True, queue_ahead=False,
                   sustained=0.0):
    """Rank 0's backward slice: ours (its forward, untimed, leaves macrobatch 0 in the ring)
    against autograd through both pipelines; the floor is twice the forward's dense GEMMs.
    Effective TFLOP/s = 12 N (k+1) D I / t."""
    timed = functools.partial(time_ms, queue_ahead=queue_ahead)
    st = TrainingSteps(layer, shape, args, g)
    fwd, ours, setup, back, tg = st.fwd, st.bwd, st.setup, st.back, st.tg
    fwd()
    dx, dw1, dw2, dsw1, dsw2 = ours()
    setup()
    back()
    # rank 0's expert weight gradients see every rank's rows: both implementations
    r = dict(flops=2 * shape.forward_flops(args[0][0].shape[0]),
             err_dw1_vs_grouped=rel_error(dw1, tg.w1.grad),
             err_dw2_vs_grouped=rel_error(dw2, tg.w2.grad))
    r["mokgen_ms"] = timed(ours, iters, setup=fwd)
    r["grouped_ms"] = timed(back, iters, setup=setup)
    if sustained > 0:  # each training step (the forward its backward needs, then it)
        r["mokgen_train_sustained_ms"] = sustained_ms(lambda: (fwd(), ours()), sustained)
        r["grouped_train_sustained_ms"] = sustained_ms(lambda: (setup(), back()), sustained)
    r["naive_ms"] = float("nan")
    if naive:
        setup_n, back_n = tg.train_step("naive", st.routes, st.weights, st.dY)
        r["naive_ms"] = timed(back_n, max(10, iters // 5), setup=setup_n)
    r["floor_ms"] = 2 * fwd_floor_ms
    for k in ("mokgen", "grouped", "naive", "floor"):
        r[f"{k}_tflops"] = r["flops"] / r[f"{k}_ms"] / 1e9
    r["comm_sms"] = layer.plan.comm_sms_bwd
    return r


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mokgen bench",
                                 description="per-rank slice benchmark against PyTorch baselines")
    add_arguments(ap)
    return ap


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of `python -m mokgen bench` (mokgen.cli's subcommand and parser())."""
    ap.add_argument("--shapes", default="kimi-k2.7,glm-5.2,qwen3.5-397b-a17b,deepseek-v4-pro",
                    help="comma list of shape presets (default: %(default)s)")
    ap.add_argument("--tokens", default="1024,2048,4096",
                    help="comma list of tokens per rank (default: %(default)s)")
    ap.add_argument("--ep", default="8,64",
                    help="comma list of expert-parallel degrees, each run as rank 0's slice on "
                         "this GPU (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=50,
                    help="timed runs per measurement; the median is kept (default: %(default)s)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."),
                    help="folder of the result JSON (default: $OUT, else the current "
                         "directory)")
    ap.add_argument("--comm-sms", default="", help="comma list: sweep comm_sms_fwd")
    ap.add_argument("--comm-sms-bwd", default="",
                    help="comma list: sweep comm_sms_bwd (with --backward)")
    ap.add_argument("--minibatch", default="", help="comma list: sweep the minibatch")
    ap.add_argument("--backward", action="store_true",
                    help="also time the backward (ours vs autograd through the baselines)")
    ap.add_argument("--no-naive", action="store_true",
                    help="skip the per-expert loop baseline (slow at many local experts)")
    return ap


def main(argv=None) -> int:
    return run(parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    try:
        configs = _configs(args)  # argument errors before any GPU work
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, ep, n, ov in progress(configs, "bench"):
        r = bench_one(name, ep, n, args.iters, g, backward=args.backward,
                      naive=not args.no_naive, **ov)
        gc.collect()
        torch.cuda.empty_cache()
        r["overrides"] = ov
        rows.append(r)
        print(json.dumps(r), flush=True)
    fname = "moe_layer_fwd_bf16_sweep.json" if args.comm_sms or args.comm_sms_bwd or \
        args.minibatch else \
        "moe_layer_fwdbwd_bf16.json" if args.backward else "moe_layer_fwd_bf16.json"
    meta = save_results(os.path.join(args.out, fname), rows)
    print(f"\n{meta}")
    print(f"{'shape':<18}{'ep':>3}{'N':>6} {'comm':>4} {'mb':>5} {'mokgen':>8} {'grouped':>8} {'naive':>8} {'floor':>8}"
          f"  TFLOP/s   x_best  %floor  err      sched/mega/sum ms")
    for r in rows:
        best = max(r["grouped_tflops"], r["naive_tflops"])
        print(f"{r['shape']:<18}{r['ep']:>3}{r['tokens']:>6} {r['plan']['comm_sms']:>4} "
              f"{r['plan']['minibatch']:>5} {r['mokgen_tflops']:8.0f} "
              f"{r['grouped_tflops']:8.0f} {r['naive_tflops']:8.0f} {r['floor_tflops']:8.0f}"
              f"  {r['mokgen_tflops'] / best:8.2f} {100 * r['mokgen_tflops'] / r['floor_tflops']:6.0f}%"
              f"  {r['err_vs_grouped']:.1e}  " + "/".join(f"{v:.3f}" for v in r["stage_ms"].values()))
    if args.backward:
        print(f"\nbackward {'shape':<18}{'ep':>3}{'N':>6} {'comm':>4} {'mokgen':>8} "
              f"{'grouped':>8} {'naive':>8} {'floor':>8}  TFLOP/s  x_best  %floor  dW err")
        for r in rows:
            b = r["backward"]
            best = max(b["grouped_tflops"], b["naive_tflops"])
            print(f"backward {r['shape']:<18}{r['ep']:>3}{r['tokens']:>6} {b['comm_sms']:>4} "
                  f"{b['mokgen_tflops']:8.0f} {b['grouped_tflops']:8.0f} {b['naive_tflops']:8.0f} "
                  f"{b['floor_tflops']:8.0f}  {b['mokgen_tflops'] / best:7.2f} "
                  f"{100 * b['mokgen_tflops'] / b['floor_tflops']:6.0f}%  "
                  f"{max(b['err_dw1_vs_grouped'], b['err_dw2_vs_grouped']):.1e}")
    return 0


def results_commit() -> str:
    """The commit a result records: MOKGEN_COMMIT (mokgen.config), else the checkout's git
    HEAD, else "?"."""
    if CONFIG.commit:
        return CONFIG.commit
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=here).stdout.strip() or "?"
    except OSError:
        return "?"


def save_results(path: str, rows: list, **plot_kw) -> dict:
    """Write {meta, rows} JSON (GPU, versions, commit: $MOKGEN_COMMIT, else git's) and its PNG
    next to it (plot_kw: mokgen.harness.plot.plot's impls / what; skipped without matplotlib)."""
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                cuda=torch.version.cuda, commit=results_commit(),
                time=time.strftime("%Y-%m-%d %H:%M"))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    try:
        from mokgen.harness.plot import plot

        plot(path, path[:-5] + ".png", **plot_kw)
    except ImportError as e:  # matplotlib is optional
        print(f"no plot: {e}")
    return meta


def _ints(text: str, what: str) -> list:
    try:
        out = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise ValueError(f"{what} must be a comma-separated list of integers, got {text!r}")
    if any(v <= 0 for v in out):
        raise ValueError(f"{what} must be positive, got {text!r}")
    return out


def _configs(args) -> list:
    """(shape, ep, tokens, overrides) of every run, validated against the planner."""
    shapes = [mokgen.shapes.get(name).name for name in args.shapes.split(",")]
    sweeps = [{}]
    if args.comm_sms:
        sweeps = [dict(comm_sms_fwd=c) for c in _ints(args.comm_sms, "--comm-sms")]
    if args.comm_sms_bwd:
        sweeps = [dict(s, comm_sms_bwd=c) for s in sweeps
                  for c in _ints(args.comm_sms_bwd, "--comm-sms-bwd")]
    if args.minibatch:
        sweeps = [dict(s, minibatch=b) for s in sweeps for b in _ints(args.minibatch, "--minibatch")]
    out = [(name, ep, n, ov) for name in shapes for ep in _ints(args.ep, "--ep")
           for n in _ints(args.tokens, "--tokens") for ov in sweeps]
    for name, ep, n, ov in out:
        mokgen.plan(mokgen.shapes.get(name), ep=ep, tokens_per_rank=n, **ov)
    return out


if __name__ == "__main__":
    sys.exit(main())
