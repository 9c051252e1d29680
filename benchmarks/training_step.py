"""What does a training step cost in time and energy, against the PyTorch a user would write?
One GPU, ep = 1: the layer's training step (forward, then backward) run back to back at the
board's power cap, mokgen against autograd through torch._grouped_mm (benchmarks/models.py's
baseline) on the same inputs (mokgen.harness.bench.TrainingSteps), and the dense bf16 GEMMs of the
same FLOPs (the floor: three times the forward's, mokgen.harness.bench.dense_floor).

    python benchmarks/training_step.py [--models mixtral-8x22b,qwen3-30b-a3b] [--tokens 4096]
        [--seconds 3] [--settle 0.2] [--out DIR]
        each side's step back to back for SECONDS, twice, alternated (ours, grouped, floor,
        ours, grouped, floor); NVML's energy counter over each run after its first SETTLE
        seconds (the start runs before the power cap sets the clock) -> ms and J a step, W,
        and the SM clock sampled between batches; medians of the two runs.
    ncu --profile-from-start off ... python benchmarks/training_step.py --models M --profile ours
        one step of that side (ours | grouped | floor) between cudaProfilerStart / Stop, after
        two unprofiled ones: what ncu's metrics (DRAM and L2 bytes) see of exactly one step.

At the power cap a step's time follows its energy: the J-a-step ratio bounds the capped speed
ratio. Rows go into DIR/training_step.json (rows per GPU kind, benchmarks/result_file.py).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import torch  # noqa: E402

import mokgen  # noqa: E402
from mokgen.harness.bench import TrainingSteps, dense_floor, make_slice  # noqa: E402

import result_file  # noqa: E402

SIDES = ("ours", "grouped", "floor")


class Nvml:
    """The few NVML calls used (libnvidia-ml through ctypes: no pynvml on the GPU machine)."""

    def __init__(self, index: int = 0):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.h = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.h)),
                    "nvmlDeviceGetHandleByIndex_v2")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: NVML error {rc}")

    def energy_mj(self) -> int:  # since the driver loaded
        e = ctypes.c_ulonglong()
        self._check(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.h, ctypes.byref(e)),
                    "nvmlDeviceGetTotalEnergyConsumption")
        return e.value

    def sm_clock_mhz(self) -> int:
        c = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetClockInfo(self.h, 1, ctypes.byref(c)),  # NVML_CLOCK_SM
                    "nvmlDeviceGetClockInfo")
        return c.value


def steps(model: str, tokens: int):
    """(ours, grouped, floor, shape): callables running one training step (forward, then
    backward) as mokgen.harness.bench.bench_backward times them (its TrainingSteps, the same inputs),
    and its FLOPs in dense GEMMs."""
    shape = mokgen.shapes.get(model)
    g = torch.Generator(device="cuda").manual_seed(0)
    xs, zs, w1, w2, sw1, sw2 = make_slice(shape, 1, tokens, g)
    layer = mokgen.compile(shape, ep=1, tokens_per_rank=tokens, virtual=True)
    st = TrainingSteps(layer, shape, (xs, zs, [w1], [w2], sw1, sw2), g)

    def ours():
        st.fwd()
        st.bwd()

    def grouped():
        st.setup()
        st.back()

    gemms = dense_floor(shape, tokens, "cuda", g)

    def floor():
        for _ in range(3):
            gemms()
    return ours, grouped, floor, shape


def energy_run(nv: Nvml, fn, seconds: float, settle: float, batch: int = 5) -> dict:
    """fn() back to back: `settle` seconds first, then `seconds` counted (a sync every `batch`
    calls, the SM clock read while a batch is queued)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < settle:  # until the power cap has set the clock
        for _ in range(batch):
            fn()
        torch.cuda.synchronize()
    n, clocks = 0, []
    e0, t0 = nv.energy_mj(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(batch):
            fn()
        n += batch
        clocks.append(nv.sm_clock_mhz())  # the GPU is busy with the batch queued behind
        torch.cuda.synchronize()
    dt, de = time.perf_counter() - t0, nv.energy_mj() - e0
    return dict(steps=n, ms=1e3 * dt / n, j_per_step=de / 1e3 / n, watts=de / 1e3 / dt,
                sm_mhz=statistics.median(clocks))


def measure(nv: Nvml, model: str, tokens: int, seconds: float, settle: float) -> dict:
    """One row: each side's medians over two alternated runs, and the ratios."""
    ours, grouped, floor, shape = steps(model, tokens)
    fns = dict(ours=ours, grouped=grouped, floor=floor)
    runs = {side: [] for side in SIDES}
    for side in SIDES + SIDES:
        runs[side].append(energy_run(nv, fns[side], seconds, settle))
    flops = 3 * shape.forward_flops(tokens)
    row = dict(model=model, tokens=tokens, flops=flops, seconds=seconds, settle_s=settle)
    for side, rs in runs.items():
        for k in rs[0]:
            row[f"{side}_{k}"] = statistics.median(r[k] for r in rs)
        row[f"{side}_tflops"] = flops / row[f"{side}_ms"] / 1e9
        row[f"{side}_tflop_per_j"] = flops / row[f"{side}_j_per_step"] / 1e12
    for side in ("grouped", "floor"):
        row[f"{side}_over_ours_time"] = row[f"{side}_ms"] / row["ours_ms"]
        row[f"{side}_over_ours_energy"] = row[f"{side}_j_per_step"] / row["ours_j_per_step"]
    row["runs"] = runs
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/training_step.py",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mixtral-8x22b,qwen3-30b-a3b",
                    help="comma list of model presets (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens a step")
    ap.add_argument("--seconds", type=float, default=3.0,
                    help="seconds each side's run is counted (default: %(default)s)")
    ap.add_argument("--settle", type=float, default=0.2,
                    help="seconds each run runs before it is counted (default: %(default)s)")
    ap.add_argument("--profile", choices=SIDES,
                    help="only one step of this side between cudaProfilerStart / Stop (ncu)")
    ap.add_argument("--out", default=result_file.RESULTS,
                    help="folder of training_step.json (default: %(default)s)")
    a = ap.parse_args(argv)
    if a.profile:
        model = a.models.split(",")[0]
        fn = dict(zip(SIDES, steps(model, a.tokens)))[a.profile]
        fn()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"{model} T {a.tokens}: one {a.profile} step profiled")
        return 0
    nv = Nvml()
    rows = []
    for model in a.models.split(","):
        row = measure(nv, model, a.tokens, a.seconds, a.settle)
        rows.append(row)
        for side in SIDES:
            print(f"{model} T {a.tokens} {side:8s}: {row[side + '_ms']:.3f} ms a step, "
                  f"{row[side + '_tflops']:.0f} TFLOP/s, {row[side + '_j_per_step']:.3f} J a "
                  f"step, {row[side + '_watts']:.0f} W, SM {row[side + '_sm_mhz']:.0f} MHz, "
                  f"{row[side + '_tflop_per_j']:.2f} TFLOP/J", flush=True)
        print(f"{model} T {a.tokens}: grouped/ours time {row['grouped_over_ours_time']:.3f}, "
              f"energy {row['grouped_over_ours_energy']:.3f}; floor/ours time "
              f"{row['floor_over_ours_time']:.3f}, energy {row['floor_over_ours_energy']:.3f}",
              flush=True)
        path = result_file.write("training_step", [row], ("model", "tokens"), out=a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
