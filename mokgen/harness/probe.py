"""Measure this GPU's rates, the numbers the cost models take (mokgen/compiler/hardware.py):

- bf16_flops / fp8_flops: dense GEMMs on random data, 8192^3 (torch.matmul; torch._scaled_mm
  with e4m3 operands and per-tensor scales, bf16 out);
- hbm_bw: a 1 GiB device-to-device copy, read + write counted;
- copy_bw_per_sm: bytes a CTA of 384 threads moves with 16-byte loads and stores, 8 in flight
  a thread (as the comm CTAs pull rows), from the rate of 8 CTAs copying apart;
- flag_latency: one release/acquire hand-off between two CTAs on two SMs (sync.cuh's
  st_release_gpu and wait_at_least, its poll included), half a ping-pong round trip.

The link rates (nvlink_bw, peer_flag_latency) need two GPUs: they stay the kind's. Prints a
hardware.py entry ready to paste and the measurements as JSON; about half a minute (the two
small kernels build with nvcc once, then come from the cache).

    python -m mokgen.harness.probe [--out probe.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch

from mokgen.compiler import hardware

KERNELS = r"""
#include <cstdint>
#include "mokgen/sync.cuh"

// Each CTA copies its own contiguous share, 8 16-byte loads in flight a thread, `iters` times.
extern "C" __global__ void __launch_bounds__(384, 1)
probe_copy(const int4* __restrict__ src, int4* __restrict__ dst, long long n16, int iters) {
  const long long per = n16 / gridDim.x;
  const int4* s = src + blockIdx.x * per;
  int4* d = dst + blockIdx.x * per;
  constexpr int U = 8;
  for (int it = 0; it < iters; ++it) {
    for (long long i = threadIdx.x; i < per; i += (long long)blockDim.x * U) {
      int4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (i + u * blockDim.x < per) v[u] = s[i + u * blockDim.x];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (i + u * blockDim.x < per) d[i + u * blockDim.x] = v[u];
    }
  }
}

// CTAs 0 and 1 (two SMs: each takes most of an SM's shared memory) hand a flag back and
// forth `rounds` times; out[0] = CTA 0's nanoseconds for all of them.
extern "C" __global__ void __launch_bounds__(384, 1)
probe_pingpong(uint32_t* flags, int rounds, unsigned long long* out) {
  if (threadIdx.x != 0) return;
  uint32_t* mine = flags + 32 * blockIdx.x;
  uint32_t* theirs = flags + 32 * (1 - blockIdx.x);
  const uint64_t t0 = mokgen::global_ns();
  for (uint32_t i = 1; i <= (uint32_t)rounds; ++i) {
    if (blockIdx.x == 0) {
      mokgen::st_release_gpu(mine, i);
      if (!mokgen::wait_at_least(theirs, i, 0, 0, (int)i)) return;
    } else {
      if (!mokgen::wait_at_least(theirs, i, 1, 0, (int)i)) return;
      mokgen::st_release_gpu(mine, i);
    }
  }
  if (blockIdx.x == 0) out[0] = mokgen::global_ns() - t0;
}
"""


def _timed(fn, iters: int, repeats: int = 5) -> float:
    """Median seconds of one `fn()` over `repeats` batches of `iters` back to back."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / iters)
    return statistics.median(out)


def gemm_flops(n: int = 8192) -> dict:
    """Dense bf16 and fp8 GEMM FLOP/s on random n x n x n operands."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = {"bf16_flops": 2 * n**3 / _timed(lambda: a @ b, 10)}
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda", dtype=torch.float32)
    try:
        f = lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,  # noqa: E731
                                     out_dtype=torch.bfloat16)
        out["fp8_flops"] = 2 * n**3 / _timed(f, 10)
    except (RuntimeError, TypeError) as e:  # an older torch's _scaled_mm signature
        print(f"fp8 GEMM not measured: {e}", file=sys.stderr)
    return out


def copy_bw(nbytes: int = 1 << 30) -> float:
    """Device copy bytes/s, read + write counted (hardware.GPU.hbm_bw)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), 10)


def _kernels():
    """The probe kernels' module (built with nvcc through mokgen's cache), or None."""
    import shutil

    from mokgen.compiler import build
    from mokgen.config import CONFIG
    from mokgen.runtime import cuda

    if shutil.which(CONFIG.nvcc) is None:
        print(f"no {CONFIG.nvcc}: copy_bw_per_sm and flag_latency not measured", file=sys.stderr)
        return None
    (binary,) = build.build([build.Kernel("probe", KERNELS)])
    return cuda.load_module(binary.image)


def copy_bw_per_sm(mod, ctas: int = 8, nbytes: int = 256 << 20) -> float:
    """Bytes/s one CTA copies (payload: each byte read once, written once), from `ctas` CTAs
    copying their own shares of a buffer larger than L2."""
    from mokgen.runtime import cuda

    f = mod.function("probe_copy")
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    n16 = nbytes // 16
    stream = torch.cuda.current_stream()
    run = lambda: cuda.launch(f, ctas, 384, 0, stream,  # noqa: E731
                              [src, dst, cuda.I64(n16), 1])
    return nbytes / _timed(run, 3) / ctas


def flag_latency(mod, rounds: int = 20000) -> float:
    """Seconds of one release/acquire hand-off between two SMs."""
    from mokgen.runtime import cuda

    smem = 200 * 1024  # one CTA an SM
    f = mod.function("probe_pingpong", smem)
    flags = torch.zeros(64, dtype=torch.int32, device="cuda")
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    times = []
    for _ in range(5):
        flags.zero_()
        cuda.launch(f, 2, 384, smem, torch.cuda.current_stream(), [flags, rounds, out],
                    cooperative=True)
        torch.cuda.synchronize()
        times.append(out.item() * 1e-9 / (2 * rounds))
    return statistics.median(times)


def measure() -> dict:
    torch.cuda.init()
    gpu = hardware.current()
    got = {**gemm_flops(), "hbm_bw": copy_bw()}
    mod = _kernels()
    if mod is not None:
        got.update(copy_bw_per_sm=copy_bw_per_sm(mod), flag_latency=flag_latency(mod))
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"device": props.name, "kind": gpu.name, "num_sms": gpu.num_sms,
            "torch": torch.__version__, "cuda": torch.version.cuda, "measured": got,
            "table": {k: getattr(hardware.get(gpu.name), k) for k in got}}


def _literal(v) -> str:
    """A rate as hardware.py writes it: 750e12, 40e9, 2e-06."""
    if isinstance(v, float) and v >= 1e11:
        return f"{v / 1e12:.4g}e12"
    if isinstance(v, float) and v >= 1e6:
        return f"{v / 1e9:.4g}e9"
    return repr(v)


def entry(result: dict) -> str:
    """The kind's hardware.py entry with the measured rates in (the link rates kept)."""
    kind = hardware.get(result["kind"])
    rates = {k: float(f"{v:.3g}") for k, v in result["measured"].items()}
    g = dataclasses.replace(kind, **rates, measured=True)
    fields = [f"{f.name}={_literal(getattr(g, f.name))}" for f in dataclasses.fields(g)
              if f.name not in ("device", "hbm_exposed")]
    lines, line = [], "   "
    for f in fields:
        if len(line) + len(f) + 2 > 92:
            lines.append(line.rstrip())
            line = "   "
        line += f" {f},"
    lines.append(line.rstrip())
    var = result["kind"].upper().replace("-", "_")
    return (f"# measured on {result['device']} ({result['num_sms']} SMs) by "
            f"python -m mokgen.harness.probe, torch {result['torch']}; nvlink_bw and "
            f"peer_flag_latency: the table's\n{var} = GPU(\n" + "\n".join(lines) + "\n)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mokgen.harness.probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the probe measures a GPU; none is visible", file=sys.stderr)
        return 2
    result = measure()
    for k, v in result["measured"].items():
        was = result["table"][k]
        print(f"{k:>15} {v:12.4g}   (table {was:.4g}, x{v / was:.2f})")
    print(entry(result))
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
