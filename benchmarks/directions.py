"""The communication-direction ablation (paper 3.1, issue #18): the layer's forward, its
backward and its training step with every direction the kernels implement, timed side by side:

    python benchmarks/directions.py [--shape kimi-k2.7] [--load ep8] [--tokens 2048]  # virtual
    torchrun --nproc-per-node=2 benchmarks/directions.py ...                          # real
    python benchmarks/directions.py --prebuild --world 2   # compile ahead, no GPU (nvcc)

Each GPU carries one rank's load of the preset's deployment (multigpu.load_shape: L = E/64 or
E/8 local experts, N tokens). Per (dispatch, combine), the backward the paper's: forward ms
and training-step ms (forward + backward megakernels through autograd), the slowest rank's
median; the cost model's seconds (comm_direction.forward_costs) beside them; which one the
pass picks unforced (`chosen`) and whether it is the fastest or within noise of it (noise: the
spread of --repeats medians of the fastest). Then per (reverse_combine, reverse_dispatch), the
forward the paper's: backward ms (autograd's backward alone, after an untimed forward) and
training-step ms, comm_direction.backward_costs, the pass's choice judged the same way.
Every other decision (minibatch, ring, comm CTAs, >= 2 for pull combine or pull
reverse-dispatch) is pinned to one value per table, so the outputs and every gradient must be
bitwise equal to the paper's directions': checked.

Virtual ranks: push dispatch, pull combine, push reverse-combine and pull reverse-dispatch wait
on peers inside the megakernel, so the R ranks' megakernels run at once on one GPU, each on
SMs / R of it (reserve_sms): every direction runs so here, the paper's too, for a fair
comparison; the "links" are then HBM.
Real ranks (torchrun, WORLD_SIZE > 1): one GPU per rank over NVLink, full SMs.
JSON: $OUT/directions_{virtual,real}_R{R}.json (rows + meta); a table on stdout.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import mokgen  # noqa: E402
from mokgen.compiler.passes.comm_direction import backward_costs, forward_costs  # noqa: E402
from mokgen.harness.workloads import BACKWARD_DIRECTIONS as BACKWARD  # noqa: E402
from mokgen.harness.workloads import FORWARD_DIRECTIONS as FORWARD  # noqa: E402
from mokgen.harness.workloads import backward_direction_layers, direction_layers  # noqa: E402
H200_SMS = 132


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="kimi-k2.7", help="a preset, or gpu-small")
    ap.add_argument("--load", default="ep8", help="ep64 or ep8 (multigpu.load_shape)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ep", type=int, default=2, help="virtual ranks (real: the world size)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3, help="medians per direction (noise)")
    ap.add_argument("--no-backward", action="store_true", help="forward only (no training "
                    "step, no backward directions)")
    ap.add_argument("--comm-sms-bwd", type=int, default=None, help="the backward table's comm "
                    "CTAs (default: the plan's, >= 2; pull reverse-dispatch pulls with half)")
    ap.add_argument("--prebuild", action="store_true", help="compile the kernels, no GPU")
    ap.add_argument("--world", type=int, default=None, help="--prebuild: the real world size "
                    "to build for (default: virtual ranks, --ep)")
    ap.add_argument("--tests", action="store_true", help="--prebuild: also the direction "
                    "tests' layers (tests/test_gpu_directions.py, or test_multigpu.py's)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    return ap.parse_args(argv)


def layer_shape(args, R: int) -> mokgen.MoEShape:
    if args.shape == "gpu-small":
        return mokgen.shapes.get("gpu-small")
    import multigpu

    return multigpu.load_shape(args.shape, args.load, R)


def plans(args, R: int, virtual: bool, sms: int = H200_SMS) -> dict:
    """(dispatch, combine) -> the overrides of its layer, every other decision pinned
    (mokgen.harness.workloads.direction_layers); "chosen" -> the same pins with the directions left
    to the pass (the model's choice)."""
    common = dict(reserve_sms=sms - sms // R) if virtual else {}  # R megakernels at once
    out = direction_layers(layer_shape(args, R), R, args.tokens, **common)
    out["chosen"] = {k: v for k, v in out[("pull", "push")].items()
                     if k not in ("dispatch", "combine")}
    return out


def backward_plans(args, R: int, virtual: bool, sms: int = H200_SMS) -> dict:
    """(reverse_combine, reverse_dispatch) -> the overrides of its layer, the forward's
    directions the paper's and every other decision pinned
    (mokgen.harness.workloads.backward_direction_layers); "chosen" -> the backward's left to the pass."""
    common = dict(reserve_sms=sms - sms // R) if virtual else {}
    if args.comm_sms_bwd is not None:
        common["comm_sms_bwd"] = args.comm_sms_bwd
    out = backward_direction_layers(layer_shape(args, R), R, args.tokens, **common)
    out["chosen"] = {k: v for k, v in out[("pull", "push")].items()
                     if k not in ("reverse_combine", "reverse_dispatch")}
    return out


def test_layers(R: int | None, sms: int = H200_SMS) -> list:
    """(shape, kwargs) of the layers tests/test_gpu_directions.py (R None: virtual ranks) or
    the direction test of tests/test_multigpu.py (R ranks) compiles (keep in step)."""
    shape = mokgen.shapes.get("gpu-small")
    if R is None:
        sys.path.insert(0, os.path.join(HERE, "..", "tests"))
        import test_gpu_directions as t

        return [(shape, kw) for tokens, pinned in t.CASES.values()
                for kw in t.layer_kwargs(shape, tokens, sms, **pinned).values()] + \
            [(shape, kw) for tokens, pinned, _ in t.BWD_CASES.values()
             for kw in t.backward_layer_kwargs(shape, tokens, sms, **pinned).values()]
    return [(shape, kw) for kw in direction_layers(shape, R, 700, minibatch=128,
                                                   macrobatch=256).values()] + \
        [(shape, kw) for kw in backward_direction_layers(shape, R, 700, minibatch=128,
                                                         macrobatch=256).values()]


def prebuild(args) -> int:
    from mokgen.pytorch.api import build_plans

    virtual = args.world is None
    R = args.ep if virtual else args.world
    shape = layer_shape(args, R)
    ps = [mokgen.plan(shape, **kw) for k, kw in plans(args, R, virtual).items()
          if k != "chosen"]
    ps += [mokgen.plan(shape, **kw) for k, kw in backward_plans(args, R, virtual).items()
           if k != "chosen"]
    if args.tests:
        ps += [mokgen.plan(s, **kw) for s, kw in test_layers(None if virtual else R)]
    bins = build_plans(ps)
    print(f"directions prebuild ({'virtual' if virtual else 'real'} R={R}): {len(bins)} kernels, "
          f"{sum(not b.cached for b in bins)} built -> {mokgen.config.CONFIG.cache}")
    return 0


# ------------------------------------------------------------------------------ on the GPU
class Runner:
    """One rank's view (real) or all R ranks' (virtual): inputs, calls, a max over ranks."""

    def __init__(self, shape, R: int, n: int, real: bool):
        from mokgen.harness.workloads import make_inputs

        self.real, self.R = real, R
        if real:
            import multigpu

            (x, z, w1, w2, sw1, sw2), dy = multigpu.rank_inputs(shape, n)
            self.args, self.dys = (x, z, w1, w2, sw1, sw2), [dy]
        else:
            inp = make_inputs(shape, R, n, seed=1234)
            self.args = (inp["x"], inp["router_logits"], inp["w1"], inp["w2"], inp["shared_w1"],
                         inp["shared_w2"])
            import torch

            g = torch.Generator(device="cuda").manual_seed(99)
            self.dys = [torch.randn(x.shape, device="cuda", generator=g).bfloat16()
                        for x in inp["x"]]

    def ms(self, fn, iters: int, setup=None) -> float:
        import torch
        from mokgen.harness.bench import time_ms

        t = time_ms(fn, iters, warmup=5, setup=setup)
        if not self.real:
            return t
        import torch.distributed as dist

        v = torch.tensor([t], device="cuda")
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return v.item()

    def forward(self, layer):
        import torch

        with torch.no_grad():
            ys = layer(*self.args)
        return ys if isinstance(ys, list) else [ys]

    def train_step(self, layer):
        """A callable: leaves' grads cleared, forward, backward from dy."""
        import torch

        def leaf(t):
            return t if t is None else t.detach().requires_grad_()
        leaves = [[leaf(t) for t in a] if isinstance(a, list) else leaf(a) for a in self.args]

        def run():
            for t in self.flat(leaves):
                t.grad = None
            ys = layer(*leaves)
            torch.autograd.backward(ys if isinstance(ys, list) else [ys], self.dys)
        run.leaves = leaves
        return run

    def grads_step(self, layer, gs0):
        """The layer's training step, run once: (the step, whether its gradients are bitwise
        gs0's, gs0 or, the first time, these gradients)."""
        import torch

        step = self.train_step(layer)
        step()
        torch.cuda.synchronize()
        gs = [t.grad.clone() for t in self.flat(step.leaves)]
        same = gs0 is None or all(torch.equal(a, b) for a, b in zip(gs0, gs))
        return step, same, gs0 or gs

    def backward_step(self, layer):
        """(setup, fn): setup clears the leaves' grads and runs the forward (untimed), fn the
        backward from dy alone."""
        import torch

        step = self.train_step(layer)
        state = {}

        def setup():
            for t in self.flat(step.leaves):
                t.grad = None
            ys = layer(*step.leaves)
            state["ys"] = ys if isinstance(ys, list) else [ys]

        def fn():
            torch.autograd.backward(state.pop("ys"), self.dys)
        return setup, fn

    @staticmethod
    def flat(leaves) -> list:
        return [t for a in leaves for t in (a if isinstance(a, list) else [a]) if t is not None]

    def all_true(self, ok: bool) -> bool:
        if not self.real:
            return ok
        import torch
        import torch.distributed as dist

        v = torch.tensor([0 if ok else 1], device="cuda")
        dist.all_reduce(v)
        return v.item() == 0


def run(args) -> None:
    import torch

    real = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if real:
        import multigpu
        import torch.distributed as dist

        multigpu.init_dist()
        R, rank = dist.get_world_size(), dist.get_rank()
    else:
        R, rank = args.ep, 0
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kws = plans(args, R, not real, sms)
    shape = layer_shape(args, R)
    pick = mokgen.plan(shape, **kws["chosen"])
    chosen = (pick.dispatch, pick.combine)
    runner = Runner(shape, R, args.tokens, real)
    group = dist.group.WORLD if real else None
    rows, ys0, gs0 = [], None, None
    for dc in FORWARD:
        layer = mokgen.compile(shape, virtual=not real, group=group, **kws[dc])
        p = layer.plan
        ys = runner.forward(layer)
        torch.cuda.synchronize()
        same = ys0 is None or all(torch.equal(a, b) for a, b in zip(ys0, ys))
        ys0 = ys0 or ys
        fwd = [runner.ms(lambda: runner.forward(layer), args.iters) for _ in range(args.repeats)]
        row = dict(dispatch=dc[0], combine=dc[1], chosen=dc == chosen,
                   fwd_ms=statistics.median(fwd), fwd_ms_repeats=fwd,
                   bitwise_equal_to_pull_push=runner.all_true(same),
                   model_us={k: 1e6 * v for k, v in forward_costs(p, *dc).items()},
                   plan=dict(comm_sms_fwd=p.comm_sms_fwd, minibatch=p.minibatch,
                             macrobatch=p.macrobatch, num_sms=p.num_sms))
        step = None
        if not args.no_backward:
            step, same, gs0 = runner.grads_step(layer, gs0)
            tr = [runner.ms(step, args.iters) for _ in range(args.repeats)]
            row.update(train_ms=statistics.median(tr), train_ms_repeats=tr,
                       grads_bitwise_equal_to_pull_push=runner.all_true(same))
        layer.synchronize()
        rows.append(row)
        del layer, step
        release()
    verdict = judge(rows)
    brows, bchosen, bverdict = [], None, {}
    if not args.no_backward:
        brows, bchosen = run_backward(args, runner, shape, R, real, sms, group)
        bverdict = judge(brows, ("reverse_combine", "reverse_dispatch"))
    if rank == 0:
        from multigpu import meta

        mode = "real" if real else "virtual"
        out = dict(mode=mode, world=R, shape=shape.name, load=args.load, tokens=args.tokens,
                   chosen=dict(dispatch=chosen[0], combine=chosen[1]), verdict=verdict,
                   meta=meta(), rows=rows, backward_rows=brows, backward_verdict=bverdict,
                   backward_chosen=None if bchosen is None else dict(
                       reverse_combine=bchosen[0], reverse_dispatch=bchosen[1]))
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"directions_{mode}_R{R}.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(table(out))
        print(f"wrote {path}")
    if real:
        dist.barrier()
        dist.destroy_process_group()


def run_backward(args, runner, shape, R: int, real: bool, sms: int, group):
    """The backward table: per (reverse_combine, reverse_dispatch), the forward the paper's,
    backward and training-step ms, the model's seconds, every gradient bitwise against the
    paper's directions'. -> (rows, the pass's unforced choice)."""
    kws = backward_plans(args, R, not real, sms)
    pick = mokgen.plan(shape, **kws["chosen"])
    chosen = (pick.reverse_combine, pick.reverse_dispatch)
    rows, gs0 = [], None
    for rr in BACKWARD:
        if rr not in kws:
            continue
        layer = mokgen.compile(shape, virtual=not real, group=group, **kws[rr])
        p = layer.plan
        step, same, gs0 = runner.grads_step(layer, gs0)
        setup, fn = runner.backward_step(layer)
        bwd = [runner.ms(fn, args.iters, setup=setup) for _ in range(args.repeats)]
        tr = [runner.ms(step, args.iters) for _ in range(args.repeats)]
        rows.append(dict(reverse_combine=rr[0], reverse_dispatch=rr[1], chosen=rr == chosen,
                         bwd_ms=statistics.median(bwd), bwd_ms_repeats=bwd,
                         train_ms=statistics.median(tr), train_ms_repeats=tr,
                         grads_bitwise_equal_to_pull_push=runner.all_true(same),
                         model_us={k: 1e6 * v for k, v in backward_costs(p, *rr).items()},
                         plan=dict(comm_sms_bwd=p.comm_sms_bwd, minibatch=p.minibatch,
                                   macrobatch=p.macrobatch, num_sms=p.num_sms)))
        layer.synchronize()
        del layer, step, setup, fn
        release()
    return rows, chosen


def release() -> None:
    """Free the layer just timed (its workspaces go with their last holder, the step
    closures included) before the next one is built: four layers' workspaces at once, each
    virtual rank with its own backward scratch side by side, ran out of an H200's memory at
    kimi-k2.7's ep8 load (an 8 GB fp32 weight-gradient accumulator per rank)."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def judge(rows, keys=("dispatch", "combine")) -> dict:
    """Per timed column: the fastest direction, the chosen one's time, the noise (the
    relative spread of the fastest's repeats, at least 1%) and whether chosen is within it.
    `keys`: the row fields naming a direction (the forward's, or the backward's)."""
    out = {}
    for col in ("fwd_ms", "bwd_ms", "train_ms"):
        if not rows or col not in rows[0]:
            continue
        best = min(rows, key=lambda r: r[col])
        pick = next(r for r in rows if r["chosen"])
        reps = best[col + "_repeats"]
        noise = max(0.01, (max(reps) - min(reps)) / min(reps))
        out[col] = dict(fastest="/".join(best[k] for k in keys), fastest_ms=best[col],
                        chosen_ms=pick[col], noise=noise,
                        chosen_ok=pick[col] <= best[col] * (1 + noise))
    return out


def table(out) -> str:
    lines = [f"directions: {out['shape']} ({out['load']}) N={out['tokens']} R={out['world']} "
             f"{out['mode']} ranks on {out['meta']['gpu']}",
             f"{'dispatch':>8} {'combine':>7} {'fwd ms':>8} {'train ms':>9} {'model us':>9} "
             f"{'bitwise':>7}  chosen"]
    for r in out["rows"]:
        same = r["bitwise_equal_to_pull_push"] and r.get("grads_bitwise_equal_to_pull_push", True)
        lines.append(f"{r['dispatch']:>8} {r['combine']:>7} {r['fwd_ms']:8.3f} "
                     f"{r.get('train_ms', float('nan')):9.3f} {r['model_us']['total']:9.1f} "
                     f"{'yes' if same else 'NO':>7}  "
                     f"{'<- chosen' if r['chosen'] else ''}")
    lines += verdict_lines(out["verdict"])
    if out.get("backward_rows"):
        lines.append(f"{'rev comb':>8} {'rev disp':>8} {'bwd ms':>7} {'train ms':>9} "
                     f"{'model us':>9} {'bitwise':>7}  chosen")
        for r in out["backward_rows"]:
            lines.append(f"{r['reverse_combine']:>8} {r['reverse_dispatch']:>8} "
                         f"{r['bwd_ms']:7.3f} {r['train_ms']:9.3f} "
                         f"{r['model_us']['total']:9.1f} "
                         f"{'yes' if r['grads_bitwise_equal_to_pull_push'] else 'NO':>7}  "
                         f"{'<- chosen' if r['chosen'] else ''}")
        lines += verdict_lines(out["backward_verdict"])
    return "\n".join(lines)


def verdict_lines(verdict) -> list:
    out = []
    for col, v in verdict.items():
        ok = "chosen is fastest or within noise" if v["chosen_ok"] else "CHOSEN IS SLOWER"
        out.append(f"{col}: fastest {v['fastest']} {v['fastest_ms']:.3f} ms, chosen "
                   f"{v['chosen_ms']:.3f} ms, noise {100 * v['noise']:.1f}%: {ok}")
    return out


def main(argv=None) -> int:
    args = parse(argv)
    if args.prebuild:
        return prebuild(args)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
