"""Deployment simulator, on paper (pure Python, no GPU): what one rank of an EP deployment
would spend per layer call, from the planning passes' cost model and published link and
tensor-core rates (mokgen/compiler/hardware.py).

    python -m mokgen simulate --shape kimi-k2.7 --ep 8,16,32,64 --system h200-nvl8
    python -m mokgen simulate --validate       # predicted vs benchmarks/results (H200 rows)

Model of one rank (uniform routing, N tokens per rank, so N k rows arrive on average):
  plan      mokgen.compiler.plan on the system's GPU: its SM partition, minibatch and ring
  compute   routed GEMM FLOPs with each expert's rows padded to the 128-row tile, plus the
            shared expert's, at the per-SM tensor rate times the compute CTAs; at least the
            time to read the local experts' weights from HBM (backward: read them and write
            their gradients)
  comm      of the rows pulled (dispatch; backward: dy) and pushed (combine; backward: dx),
            1/ep are the rank's own; the rest cross to peers, inside the NVLink domain at its
            per-direction link rate, beyond it at the scale-out NIC rate (links run in
            parallel); every row also passes the comm CTAs at their copy rate
  time      max(comm, compute) + the pipeline's fill, drain and per-minibatch waste
            (passes.granularity.minibatch_cost, at the system's link) + fixed costs (routing
            and schedule launches, the rank barriers, the owner's sum of its k rows)
Systems:
  h200-nvl8    8 H200 per NVSwitch domain, 450 GB/s per direction per GPU; ep > 8 crosses
               nodes over one 400 Gb/s InfiniBand NIC per GPU (ConnectX-7): 50 GB/s
  gb200-nvl72  72 Blackwell GPUs in one NVLink 5 domain, 900 GB/s per direction per GPU;
               beyond 72 one 800 Gb/s NIC per GPU (ConnectX-8): 100 GB/s
  h200-1gpu    virtual ranks on one H200 (the single-GPU slice benchmarks): every peer row
               is an HBM copy
mokgen today reaches peers through NVLink (symmetric memory) only and builds sm_90a only:
predictions beyond one NVLink domain, or on GB200, say what this design would do there, not
what runs. Blackwell rates are datasheet rates derated like the H200's (hardware.GB200).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from mokgen.compiler import hardware
from mokgen.compiler.passes.granularity import minibatch_cost
from mokgen.compiler.passes.sm_partition import direction_costs
from mokgen.shapes import MoEShape


@dataclass(frozen=True)
class System:
    name: str
    gpu: hardware.GPU
    domain: int          # GPUs in one NVLink domain
    link_bw: float       # bytes/s per GPU per direction inside the domain
    scale_out_bw: float  # bytes/s per GPU per direction between domains
    barrier_s: float     # one rank barrier (cross-GPU flag round trip)
    note: str


SYSTEMS = {
    "h200-nvl8": System("h200-nvl8", hardware.H200, 8, hardware.H200.nvlink_bw, 50e9, 10e-6,
                        "8 x H200 NVSwitch; 400 Gb/s IB per GPU across nodes"),
    "gb200-nvl72": System("gb200-nvl72", hardware.GB200, 72, hardware.GB200.nvlink_bw, 100e9,
                          10e-6, "72 x Blackwell NVLink 5; 800 Gb/s per GPU beyond"),
    "h200-1gpu": System("h200-1gpu", hardware.H200, 1 << 30, hardware.H200.hbm_bw / 2,
                        hardware.H200.hbm_bw / 2, 0.0, "virtual ranks on one H200"),
}
# Calibration (fitted on the layer benchmark's ep=64 single-GPU slices; the ep=8 slices and the
# real-rank runs are out of sample): a GEMM tile's fixed cost in K steps, and the share of the
# tensor rate the megakernels' GEMMs sustain per direction.
K_FIXED = 512
EFFICIENCY = {"fwd": 1.0, "bwd": 0.87}
LAUNCH_S = 5e-6      # one small kernel's launch-to-launch cost on the stream
PROLOGUE_KERNELS = 4  # route, three schedule kernels


def get_system(name: str) -> System:
    if name not in SYSTEMS:
        raise ValueError(f"system must be one of {sorted(SYSTEMS)}, got {name!r}")
    return SYSTEMS[name]


def layer_shape(shape: MoEShape, ep: int, local_experts: int | None) -> MoEShape:
    """`shape` with ep * local_experts experts (one rank's load of a larger deployment, as
    benchmarks/multigpu.py runs it), or unchanged."""
    if local_experts is None:
        return shape
    return MoEShape(ep * local_experts, shape.hidden, shape.intermediate, shape.topk,
                    shape.shared_experts, shape.shared_intermediate, name=shape.name)


def _link_seconds(moved: float, ep: int, system: System) -> float:
    """Seconds the off-rank share of `moved` bytes (per direction) needs on the links."""
    if system.name == "h200-1gpu" or ep == 1:
        return moved / system.link_bw
    off = moved * (ep - 1) / ep
    near = off * (min(ep, system.domain) - 1) / (ep - 1)
    return max(near / system.link_bw, (off - near) / system.scale_out_bw)


def gemm_flops(plan, padded: int, backward: bool) -> tuple[float, float]:
    """FLOPs the tensor cores spend on one call's GEMMs (routed rows padded to the tile),
    each tile's K stretched by K_FIXED: its fixed cost (pipeline fill, epilogue) in K steps.
    -> (FLOPs in the plan's precision, FLOPs in bf16): the shared expert and the weight
    gradients run in bf16 whatever the plan's dtype (docs/fp8.md); a bf16 plan's FLOPs are
    all in the first."""
    s, n = plan.shape, plan.tokens_per_rank
    D, I, IS, L, k0 = s.hidden, s.intermediate, s.shared_dim, plan.local_experts, K_FIXED
    ns = -(-n // plan.block_m) * plan.block_m
    mm = lambda m, n_, k: 2 * m * n_ * (k + k0)  # noqa: E731
    if not backward:  # gate/up (K = D) and down (K = I), routed and shared
        low, bf16 = mm(padded, 2 * I, D) + mm(padded, D, I), mm(ns, 2 * IS, D) + mm(ns, D, IS)
    else:
        kpe = padded // L  # the weight gradients' K: one expert's rows
        # dgrad, dx and the replay of gate/up in the plan's precision; the weight gradients
        # (the gate/up stays from the forward, as the ring does) and the shared expert's bf16
        low = mm(padded, I, D) + mm(padded, D, 2 * I) + mm(plan.expected_replay_rows, 2 * I, D)
        bf16 = L * (mm(D, I, kpe) + mm(2 * I, D, kpe))
        if IS:
            bf16 += mm(ns, IS, D) + mm(ns, D, 2 * IS) + mm(D, IS, ns) + mm(2 * IS, D, ns)
    return (low, bf16) if plan.scale_block else (low + bf16, 0.0)


def predict_plan(plan, system: str | System) -> dict:
    """Per-rank forward and backward of a finished plan on `system`: ms and their parts."""
    sysm = get_system(system) if isinstance(system, str) else system
    gpu = plan.target
    s, n, L = plan.shape, plan.tokens_per_rank, plan.local_experts
    rows = n * s.topk
    per_expert = rows / L
    padded = L * math.ceil(per_expert / plan.block_m) * plan.block_m
    rate = (gpu.fp8_flops if plan.scale_block == 128 else gpu.bf16_flops) / gpu.num_sms
    wbytes = L * 3 * s.intermediate * s.hidden * (1 if plan.scale_block else 2)
    sum_bytes = (rows + n) * s.hidden * 2  # the owner reads k rows per token, writes one
    out = {"system": sysm.name, "ep": plan.ep, "local_experts": L, "num_sms": plan.num_sms,
           "comm_sms_fwd": plan.comm_sms_fwd, "comm_sms_bwd": plan.comm_sms_bwd,
           "minibatch": plan.minibatch, "flops_fwd": s.forward_flops(n)}
    for d, backward in (("fwd", False), ("bwd", True)):
        c = plan.comm_sms_bwd if backward else plan.comm_sms_fwd
        moved, _ = direction_costs(plan, backward)
        low, bf16 = gemm_flops(plan, padded, backward)
        mem = wbytes
        if backward:
            mem = 2 * wbytes + L * 3 * s.intermediate * s.hidden * 2  # + the bf16 grads
        eff = EFFICIENCY["bwd" if backward else "fwd"]
        sms = eff * (plan.num_sms - c)
        t_comp = max(low / (rate * sms) + bf16 / (gpu.bf16_flops / gpu.num_sms * sms),
                     mem / gpu.hbm_bw)
        # no comm CTAs: one rank's GEMMs gather the rows, nothing is copied (limits.GATHER)
        t_comm = 0.0 if c == 0 else \
            max(_link_seconds(moved, plan.ep, sysm), moved / (c * gpu.copy_bw_per_sm))
        link = sysm.link_bw if plan.ep <= sysm.domain else sysm.scale_out_bw
        t_pipe = minibatch_cost(plan.replace(comm_sms_fwd=c), plan.minibatch, gpu, link)
        t_fixed = PROLOGUE_KERNELS * LAUNCH_S + 2 * sysm.barrier_s + sum_bytes / gpu.hbm_bw
        t = max(t_comm, t_comp) + t_pipe + t_fixed
        out.update({f"{d}_ms": 1e3 * t, f"{d}_comm_ms": 1e3 * t_comm,
                    f"{d}_compute_ms": 1e3 * t_comp, f"{d}_overhead_ms": 1e3 * (t_pipe + t_fixed),
                    f"{d}_bound": "comm" if t_comm > t_comp else "compute"})
    out["train_ms"] = out["fwd_ms"] + out["bwd_ms"]
    out["fwd_tflops"] = out["flops_fwd"] / out["fwd_ms"] / 1e9
    out["train_tflops"] = 3 * out["flops_fwd"] / out["train_ms"] / 1e9
    out["crosses_domain"] = plan.ep > sysm.domain
    return out


def predict(shape: MoEShape, ep: int, tokens: int, system: str, dtype: str = "bf16",
            local_experts: int | None = None, **overrides) -> dict:
    """Plan `shape` at `ep` for the system's GPU and predict one rank's call."""
    from mokgen import plan as make_plan

    sysm = get_system(system)
    p = make_plan(layer_shape(shape, ep, local_experts), ep=ep, dtype=dtype,
                  tokens_per_rank=tokens, gpu=sysm.gpu, **overrides)
    return predict_plan(p, sysm)


def table(preds: list) -> str:
    lines = [f"{'system':<12}{'ep':>4}{'L':>4}{'comm':>6}  {'fwd ms':>7} {'(comm':>6} "
             f"{'compute':>7} {'other)':>6} {'bound':>7}  {'bwd ms':>7} {'bound':>7}  "
             f"{'train':>7} {'TF/s':>5}"]
    for p in preds:
        lines.append(
            f"{p['system']:<12}{p['ep']:>4}{p['local_experts']:>4}"
            f"{p['comm_sms_fwd']:>3}/{p['comm_sms_bwd']:<2}  {p['fwd_ms']:7.3f} "
            f"{p['fwd_comm_ms']:6.3f} {p['fwd_compute_ms']:7.3f} {p['fwd_overhead_ms']:6.3f} "
            f"{p['fwd_bound']:>7}  {p['bwd_ms']:7.3f} {p['bwd_bound']:>7}  "
            f"{p['train_ms']:7.3f} {p['train_tflops']:5.0f}"
            + ("  (crosses NVLink domains)" if p["crosses_domain"] else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- validation
def _rows(path: Path, gpu: hardware.GPU) -> list:
    """A result file's rows measured on `gpu`'s kind (each row names its GPU by the driver's
    device name, "NVIDIA H200"; a file holds rows of several kinds side by side), or none
    where the file is absent."""
    if not path.exists():
        return []
    kind = re.compile(rf"\b{re.escape(gpu.name)}\b", re.IGNORECASE)
    return [r for r in json.loads(path.read_text())["rows"] if kind.search(r.get("gpu", ""))]


def validate(results_dir: str | Path = "benchmarks/results") -> list:
    """Predicted vs measured for the result files in `results_dir`, on the rows of the GPU
    the systems model (the H200): the layer benchmark's single-GPU slices (moe_layer.json:
    rank 0's forward, and its backward where measured, h200-1gpu), the same slices in
    blockwise fp8 (fp8.json: fwd8, bwd8) and the real-rank runs (multigpu.json: forward and
    training step of one rank's load, h200-nvl8)."""
    from mokgen import shapes

    out = []
    d = Path(results_dir)
    one = get_system("h200-1gpu")
    # the single-GPU slices: bf16 (moe_layer.json) and blockwise fp8 (fp8.json)
    slices = (("moe_layer", "bf16", "", lambda r: r["mokgen_ms"],
               lambda r: (r.get("backward") or {}).get("mokgen_ms")),
              ("fp8", "fp8", "8", lambda r: r["fp8_ms"], lambda r: r.get("fp8_bwd_ms")))
    for name, dtype, tag, fwd_ms, bwd_ms in slices:
        for r in _rows(d / f"{name}.json", one.gpu):
            p = predict(shapes.get(r["shape"]), r["ep"], r["tokens"], one.name,
                        **dict(r.get("overrides", {}), dtype=dtype))
            out.append(dict(source=f"{name} {r.get('commit', '?')}", shape=r["shape"],
                            ep=r["ep"], tokens=r["tokens"], what=f"fwd{tag}",
                            measured_ms=fwd_ms(r), predicted_ms=p["fwd_ms"]))
            if bwd_ms(r):
                out.append(dict(out[-1], what=f"bwd{tag}", measured_ms=bwd_ms(r),
                                predicted_ms=p["bwd_ms"]))
    nvl = get_system("h200-nvl8")
    for r in _rows(d / "multigpu.json", nvl.gpu):
        p = predict(shapes.get(r["shape"]), r["ep"], r["tokens"], nvl.name,
                    local_experts=r["local_experts"])
        base = dict(source=f"multigpu {r.get('commit', '?')}",
                    shape=f"{r['shape']} ({r.get('load', '')})", ep=r["ep"], tokens=r["tokens"])
        out.append(dict(base, what="fwd", measured_ms=r["mokgen_fwd_ms"],
                        predicted_ms=p["fwd_ms"]))
        out.append(dict(base, what="train", measured_ms=r["mokgen_train_ms"],
                        predicted_ms=p["train_ms"]))
    for v in out:
        v["error"] = v["predicted_ms"] / v["measured_ms"] - 1
    return out


def validation_table(rows: list) -> str:
    lines = [f"{'source':<20}{'shape':<30}{'ep':>3}{'N':>6} {'what':>5} {'measured':>9} "
             f"{'predicted':>9} {'error':>7}"]
    for v in rows:
        lines.append(f"{v['source']:<20}{v['shape']:<30}{v['ep']:>3}{v['tokens']:>6} "
                     f"{v['what']:>5} {v['measured_ms']:9.3f} {v['predicted_ms']:9.3f} "
                     f"{100 * v['error']:6.0f}%")
    if rows:
        for what in sorted({v["what"] for v in rows}):
            errs = [abs(v["error"]) for v in rows if v["what"] == what]
            lines.append(f"mean |error| {what}: {100 * sum(errs) / len(errs):.0f}% "
                         f"over {len(errs)} rows")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- command line
def add_arguments(ap) -> None:
    """The options of `python -m mokgen simulate` (mokgen.cli's subcommand and main())."""
    from mokgen import shapes

    ap.add_argument("--shape", help=f"preset, any case: {', '.join(shapes.names())}")
    ap.add_argument("--ep", default="8,16,32,64",
                    help="comma list of EP degrees (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=4096,
                    help="tokens per rank (default: %(default)s)")
    ap.add_argument("--dtype", default="bf16", help="bf16 | fp8 | mxfp8 (default: %(default)s)")
    ap.add_argument("--system", default="h200-nvl8",
                    help=f"one of {', '.join(SYSTEMS)} (default: %(default)s)")
    ap.add_argument("--local-experts", type=int, default=None,
                    help="experts per rank (the layer then has ep x this many): one rank's "
                         "load of a larger deployment, as benchmarks/multigpu.py runs it")
    ap.add_argument("--overlap-comm", action="store_true",
                    help="leave SMs to collectives beside the layer (the plan's reserve)")
    ap.add_argument("--json", action="store_true", help="print the predictions as JSON")
    ap.add_argument("--validate", action="store_true",
                    help="predicted vs measured for the H200 rows of the result files in "
                         "--results (moe_layer.json, multigpu.json)")
    ap.add_argument("--results", default="benchmarks/results",
                    help="folder of the benchmarks' result JSON that --validate reads "
                         "(default: %(default)s)")


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m mokgen simulate", description=(
        "predict one rank's forward / backward time in an EP deployment (no GPU)"))
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(args) -> int:
    import sys

    from mokgen import shapes

    try:
        if args.validate:
            rows = validate(args.results)
            print(json.dumps(rows, indent=1) if args.json else validation_table(rows))
            return 0
        if not args.shape:
            raise ValueError("--shape is required (or --validate)")
        sysm = get_system(args.system)
        eps = [int(v) for v in args.ep.split(",") if v]
        extra = {"overlap_comm": True} if args.overlap_comm else {}
        shape = shapes.get(args.shape)
        preds = [predict(shape, ep, args.tokens, sysm.name, args.dtype,
                         args.local_experts, **extra) for ep in eps]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(preds, indent=1))
        return 0
    print(f"{shape.name}, {args.tokens} tokens per rank, {args.dtype}, {sysm.name} "
          f"({sysm.note}); per rank, ms")
    print(table(preds))
    return 0
