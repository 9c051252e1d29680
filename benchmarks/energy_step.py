"""Energy a training step costs, mokgen against autograd through torch._grouped_mm (the
models.py baseline), one GPU, ep = 1, the same inputs (mokgen.harness.bench's slice):

    python3 benchmarks/energy_step.py MODEL TOKENS --seconds 3 [--out DIR]
        each side's step back to back for SECONDS, twice, alternated (ours, grouped, ours,
        grouped): NVML's energy counter over the run -> J a step, W, and the SM clock
        sampled between batches. At the power cap time a step ~ energy a step / cap, so the
        J-a-step ratio is the capped speed ratio's bound. A third side, "floor": the dense
        GEMMs of the same FLOPs (mokgen.harness.bench.dense_floor, three times a step: the forward's
        FLOPs each), the energy a step of bf16 GEMM alone would cost.
    ncu --profile-from-start off ... python3 benchmarks/energy_step.py MODEL TOKENS --profile ours
        one step of that side (ours | grouped | floor) between cudaProfilerStart / Stop, after two
        unprofiled ones: what ncu's metrics (DRAM and L2 bytes) see of exactly one step.

Why: the big layers' mainloops run at the tensor peak per clock, and the clock is set by the
power limit (NOTES #16 and the power cap), so what a step costs is its energy.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import mokgen  # noqa: E402
from mokgen.harness.bench import TrainingSteps, dense_floor, make_slice  # noqa: E402


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


def energy_run(nv: Nvml, fn, seconds: float, batch: int = 5) -> dict:
    for _ in range(3):
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("tokens", type=int)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--profile", choices=("ours", "grouped", "floor"))
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    ours, grouped, floor, shape = steps(a.model, a.tokens)
    fns = dict(ours=ours, grouped=grouped, floor=floor)
    if a.profile:
        fn = fns[a.profile]
        fn()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"{a.model} T {a.tokens}: one {a.profile} step profiled")
        return 0
    nv = Nvml()
    runs = {side: [] for side in fns}
    for side in ("ours", "grouped", "floor", "ours", "grouped", "floor"):
        runs[side].append(energy_run(nv, fns[side], a.seconds))
    flops = 3 * shape.forward_flops(a.tokens)
    med = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in runs.items()}
    for s, m in med.items():
        print(f"{a.model} T {a.tokens} {s:8s}: {m['ms']:.3f} ms a step, "
              f"{flops / m['ms'] / 1e9:.0f} TFLOP/s, {m['j_per_step']:.3f} J a step, "
              f"{m['watts']:.0f} W, SM {m['sm_mhz']:.0f} MHz, "
              f"{flops / m['j_per_step'] / 1e12:.2f} TFLOP/J")
    o, g, fl = med["ours"], med["grouped"], med["floor"]
    print(f"{a.model} T {a.tokens}: grouped/ours time {g['ms'] / o['ms']:.3f}, "
          f"energy {g['j_per_step'] / o['j_per_step']:.3f}; floor/ours time "
          f"{fl['ms'] / o['ms']:.3f}, energy {fl['j_per_step'] / o['j_per_step']:.3f}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"energy_{a.model}_{a.tokens}.json"), "w") as f:
            json.dump(dict(model=a.model, tokens=a.tokens, runs=runs, median=med), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
