"""GPU numbers the cost models use, in one place per GPU.

Rates are what we measured on the device machine (see benchmarks/NOTES.md), not datasheet
peaks: the passes only compare options, so consistent measured numbers matter more than
headline ones.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    arch: str
    num_sms: int
    smem_per_sm: int            # bytes of shared memory one CTA may use
    bf16_flops: float           # dense bf16 tensor-core rate, FLOP/s (measured)
    fp8_flops: float            # dense fp8 rate, FLOP/s
    hbm_bw: float               # device copy bandwidth, bytes/s (read + write counted)
    nvlink_bw: float            # unidirectional NVLink bandwidth per GPU, bytes/s
    copy_bw_per_sm: float       # bytes/s one SM moves with 16-byte loads/stores
    flag_latency: float         # seconds for a release/acquire hand-off between SMs
    # seconds for a hand-off through a flag in a peer GPU's memory (system-scope release,
    # NVLink, the waiter's poll); an estimate until benchmarks/directions.py measures it
    peer_flag_latency: float
    memory: int                 # bytes of device memory
    # the share of a weight re-read's HBM time that a layer's time shows: the reads overlap
    # the MMAs, but the GPU runs against its power cap and the traffic costs SM clock. Fit to
    # the H200's minibatch sweeps (benchmarks/NOTES.md, ninth session): passes/granularity.py
    hbm_exposed: float = 0.2


H200 = GPU(
    name="H200", arch="sm_90a", num_sms=132, smem_per_sm=227 * 1024,
    bf16_flops=750e12, fp8_flops=1400e12, hbm_bw=4.2e12, nvlink_bw=450e9,
    copy_bw_per_sm=40e9, flag_latency=2e-6, peer_flag_latency=4e-6, memory=141 * 10**9,
)

# Blackwell (the GPU of a GB200 superchip), for mokgen.harness.simulate only: no kernel is built for
# sm_100a yet, so nothing here is measured. Datasheet (NVIDIA GB200 NVL72, per GPU = rack / 72):
# dense BF16 2.5 PFLOP/s and FP8 5 PFLOP/s (360 / 720 PFLOP/s per rack with sparsity, halved),
# HBM3e 8 TB/s (576 TB/s per rack), NVLink 5 1.8 TB/s both ways (130 TB/s per rack), i.e.
# 900 GB/s per direction; 186 GB (13.4 TB per rack); 148 SMs (B200), 228 KB shared memory
# per SM. Tensor and HBM rates are derated as the H200's measured ones are to its datasheet
# (bf16 750 of 989 TFLOP/s = 0.76, HBM 4.2 of 4.8 TB/s = 0.875); the per-SM copy rate and the
# flag latency are the H200's (unmeasured on Blackwell), and so is hbm_exposed.
GB200 = GPU(
    name="GB200", arch="sm_100a", num_sms=148, smem_per_sm=227 * 1024,
    bf16_flops=0.76 * 2.5e15, fp8_flops=0.76 * 5.0e15, hbm_bw=0.875 * 8.0e12,
    nvlink_bw=900e9, copy_bw_per_sm=40e9, flag_latency=2e-6, peer_flag_latency=4e-6,
    memory=186 * 10**9,
)

_GPUS = {"H200": H200, "H100": H200, "GB200": GB200, "B200": GB200}
_ARCH_DEFAULT = {"sm_90a": H200}


def get(name_or_arch: str) -> GPU:
    if name_or_arch in _GPUS:
        return _GPUS[name_or_arch]
    if name_or_arch in _ARCH_DEFAULT:
        return _ARCH_DEFAULT[name_or_arch]
    raise ValueError(f"arch must be one of {sorted(_GPUS) + sorted(_ARCH_DEFAULT)}, "
                     f"got {name_or_arch!r}")
