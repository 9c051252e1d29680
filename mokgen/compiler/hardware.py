"""GPU numbers the cost models use: the device's own (SMs, shared memory, memory, L2) joined
with a table of rates per known kind.

Rates are measured on the device (`python -m mokgen.harness.probe` prints a ready entry), not
datasheet peaks: the passes compare options, so consistent measured numbers matter more than
headline ones. A kind nobody has measured yet carries its datasheet peaks derated as the
H200's measured rates are to its datasheet (`measured=False`).

Which GPU a plan targets (`target`): the `gpu=` it names (a kind such as "h100-sxm", or a
`GPU`), else the one `set_default` pinned, else $MOKGEN_GPU, else the current CUDA device
(`from_properties`: its name picks the kind, its SM count, shared memory, memory and L2 are
its own), else, with no GPU visible, CPU_DEFAULT. `arch=` alone names the arch's GPU: the
current device where it has that arch, else the arch's reference kind. A plan records its
GPU's kind, SM count and shared memory a block (they are in its key: kernels built ahead on a
CPU for a kind are the ones that kind finds in the cache), and `for_plan` rebuilds the GPU
the passes saw from those three.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

from mokgen.config import CONFIG


@dataclass(frozen=True)
class GPU:
    name: str                   # the kind ("H100-SXM"): the table entry its rates come from
    arch: str
    num_sms: int
    smem_per_block: int         # bytes of shared memory one CTA may use (opt-in)
    smem_per_sm: int            # bytes of shared memory an SM has
    l2_bytes: int
    memory: int                 # bytes of device memory: the device's own total where read from
    # one, else nvidia-smi's total for the kind (an "80 GB" card: 81,559 MiB)
    bf16_flops: float           # dense bf16 tensor-core rate, FLOP/s
    fp8_flops: float            # dense fp8 rate, FLOP/s
    hbm_bw: float               # device copy bandwidth, bytes/s (read + write counted)
    nvlink_bw: float            # unidirectional GPU-to-GPU bandwidth per GPU, bytes/s
    copy_bw_per_sm: float       # bytes/s one SM moves with 16-byte loads/stores
    flag_latency: float         # seconds for a release/acquire hand-off between SMs
    # seconds for a hand-off through a flag in a peer GPU's memory (system-scope release,
    # NVLink, the waiter's poll); an estimate, not yet measured
    peer_flag_latency: float
    # whether the rates were measured on this kind (else: datasheet, derated like the H200's)
    measured: bool = False
    # the share of a weight re-read's HBM time that a layer's time shows: the reads overlap
    # the MMAs, but the GPU runs against its power cap and the traffic costs SM clock. Fit to
    # the H200's minibatch sweeps: passes/granularity.py
    hbm_exposed: float = 0.2
    # the driver's name of the device this was read from ("" for a table entry): not part of
    # a plan (two H100s of one kind plan alike)
    device: str = dataclasses.field(default="", compare=False)

    def __str__(self) -> str:
        return (f"{self.name} ({self.num_sms} SMs, {self.smem_per_block // 1024} KiB shared "
                f"memory a block, {self.memory / 2**30:.0f} GiB"
                + ("" if self.measured else ", rates unmeasured") + ")")


KIB, MIB, GB = 1024, 2**20, 10**9
HOPPER_SMEM = dict(smem_per_block=227 * KIB, smem_per_sm=228 * KIB)

# Measured on an H200 (mokgen.harness.probe): dense bf16 GEMM 750 TFLOP/s of the
# datasheet's 989, fp8 1,400 of 1,979, device copy 4.2 of 4.8 TB/s; NVLink 900 GB/s both ways.
H200 = GPU(
    name="H200", arch="sm_90a", num_sms=132, **HOPPER_SMEM, l2_bytes=50 * MIB,
    memory=143771 * MIB, bf16_flops=750e12, fp8_flops=1400e12, hbm_bw=4.2e12, nvlink_bw=450e9,
    copy_bw_per_sm=40e9, flag_latency=2e-6, peer_flag_latency=4e-6, measured=True,
)

# Datasheet peaks -> the rates the cost models take: derated as the H200's measured are to
# its datasheet. The per-SM copy rate and the flag latencies are the H200's.
DERATE = dict(bf16=750 / 989, fp8=1400 / 1979, hbm=4.2 / 4.8)


def datasheet(name: str, arch: str, num_sms: int, memory: int, bf16: float, fp8: float,
              hbm: float, nvlink: float, l2_bytes: int = 50 * MIB, **kw) -> GPU:
    """An unmeasured kind from its datasheet: dense bf16 / fp8 TFLOP/s, HBM TB/s, GPU-to-GPU
    GB/s a direction."""
    return GPU(name=name, arch=arch, num_sms=num_sms, **{**HOPPER_SMEM, **kw},
               l2_bytes=l2_bytes, memory=memory, bf16_flops=DERATE["bf16"] * bf16 * 1e12,
               fp8_flops=DERATE["fp8"] * fp8 * 1e12, hbm_bw=DERATE["hbm"] * hbm * 1e12,
               nvlink_bw=nvlink * 1e9, copy_bw_per_sm=H200.copy_bw_per_sm,
               flag_latency=H200.flag_latency, peer_flag_latency=H200.peer_flag_latency,
               measured=False)


# H100 SXM5 80 GB (datasheet: dense bf16 989 / fp8 1,979 TFLOP/s, HBM3 3.35 TB/s, NVLink 4
# 900 GB/s both ways). Measured on one by `python -m mokgen.harness.probe` (torch 2.11.0+cu130,
# commit 9b5cb33); NVLink and the peer flag latency need two GPUs: the H200's.
H100_SXM = GPU(
    name="H100-SXM", arch="sm_90a", num_sms=132, **HOPPER_SMEM, l2_bytes=50 * MIB,
    memory=81559 * MIB, bf16_flops=784e12, fp8_flops=1410e12, hbm_bw=3.03e12, nvlink_bw=450e9,
    copy_bw_per_sm=37.8e9, flag_latency=0.64e-6, peer_flag_latency=4e-6, measured=True,
)
# H800 SXM5: the H100 SXM with NVLink cut to 400 GB/s both ways (200 a direction); the
# H100's rates, unmeasured on an H800 itself.
H800 = dataclasses.replace(H100_SXM, name="H800", nvlink_bw=200e9, measured=False)
# H100 PCIe 80 GB: 114 SMs, dense bf16 756 / fp8 1,513 TFLOP/s, HBM2e 2.0 TB/s; no NVLink
# (the optional bridge aside): peers over PCIe Gen5 x16, 64 GB/s a direction.
H100_PCIE = datasheet("H100-PCIe", "sm_90a", 114, 81559 * MIB, 756, 1513, 2.0, 64)
# H20: 78 SMs, dense bf16 148 / fp8 296 TFLOP/s, HBM3 4.0 TB/s, 96 GB, NVLink 900 GB/s both
# ways, 60 MB L2.
H20 = datasheet("H20", "sm_90a", 78, 97871 * MIB, 148, 296, 4.0, 450, l2_bytes=60 * MIB)

# Blackwell (the GPU of a GB200 superchip), for mokgen.harness.simulate only: no kernel is built for
# sm_100a yet, so nothing here is measured. Datasheet (NVIDIA GB200 NVL72, per GPU = rack / 72):
# dense BF16 2.5 PFLOP/s and FP8 5 PFLOP/s (360 / 720 PFLOP/s per rack with sparsity, halved),
# HBM3e 8 TB/s (576 TB/s per rack), NVLink 5 1.8 TB/s both ways (130 TB/s per rack), i.e.
# 900 GB/s per direction; 186 GB (13.4 TB per rack); 148 SMs (B200), 228 KB shared memory
# per SM. Rates derated by datasheet() as the Hopper kinds' are; the per-SM copy rate and the
# flag latencies are the H200's (unmeasured on Blackwell), and so is hbm_exposed.
GB200 = datasheet("GB200", "sm_100a", 148, 186 * GB, 2500, 5000, 8.0, 900, l2_bytes=126 * MIB)

KINDS = {g.name: g for g in (H200, H100_SXM, H800, H100_PCIE, H20, GB200)}
_ALIASES = {"h100": "H100-SXM", "h100-sxm5": "H100-SXM", "h800-sxm": "H800",
            "b200": "GB200"}
# Each arch's reference kind: what arch= alone names with no such device in hand.
ARCH_REFERENCE = {"sm_90a": "H200", "sm_100a": "GB200"}
# The GPU plans target with no GPU visible and none named: the H200, whose rates are the
# measured ones (the tests' golden plans are its); name the kind for anything else
# (gpu="h100-sxm", $MOKGEN_GPU).
CPU_DEFAULT = "H200"

# the driver's device name -> kind, first match wins ("H20" must not take "H200")
_DEVICE_NAMES = (
    (r"\bG?H200\b", "H200"), (r"\bH20\b", "H20"), (r"\bH800\b", "H800"),
    (r"\bH100\b.*\bPCIE\b", "H100-PCIe"), (r"\bH100\b", "H100-SXM"), (r"\bG?B200\b", "GB200"),
)
_CC_ARCH = {(9, 0): "sm_90a", (10, 0): "sm_100a"}


def _norm(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower())


def get(name_or_arch: str) -> GPU:
    """A kind's table entry by name ("h100-sxm", "H200", case and separators free) or an
    arch's reference kind ("sm_90a")."""
    if isinstance(name_or_arch, GPU):
        return name_or_arch
    key = _norm(str(name_or_arch))
    by_name = {_norm(k): g for k, g in KINDS.items()}
    key = _norm(_ALIASES.get(key, key))
    if key in by_name:
        return by_name[key]
    if name_or_arch in ARCH_REFERENCE:
        return KINDS[ARCH_REFERENCE[name_or_arch]]
    raise ValueError(f"gpu must be one of {sorted(k.lower() for k in KINDS)} (or an arch: "
                     f"{sorted(ARCH_REFERENCE)}), got {name_or_arch!r}")


def with_sms(kind: GPU, num_sms: int, smem_per_block: int | None = None, **device) -> GPU:
    """`kind` with another SM count (a MIG slice, a cut-down part): its tensor rates scale
    with the SMs (per-SM rates stay), bandwidths stay. `device`: other fields (memory, L2,
    the device's name) replaced as given."""
    scale = num_sms / kind.num_sms
    return dataclasses.replace(
        kind, num_sms=num_sms, smem_per_block=smem_per_block or kind.smem_per_block,
        bf16_flops=kind.bf16_flops * scale, fp8_flops=kind.fp8_flops * scale, **device)


def kind_of(device_name: str, arch: str, num_sms: int) -> GPU:
    """The table entry a device of this name is: by name, else (an unknown part of a known
    arch) the arch's kind nearest in SM count, the reference kind first on ties."""
    for pattern, kind in _DEVICE_NAMES:
        if re.search(pattern, device_name.upper()) and KINDS[kind].arch == arch:
            return KINDS[kind]
    same = [g for g in KINDS.values() if g.arch == arch]
    ref = ARCH_REFERENCE[arch]
    return min(same, key=lambda g: (abs(g.num_sms - num_sms), g.name != ref))


def from_properties(props) -> GPU:
    """The GPU a device is, from its properties (torch.cuda.get_device_properties, or any
    object with its fields: name, major, minor, multi_processor_count, total_memory, and
    where present shared_memory_per_block_optin, shared_memory_per_multiprocessor,
    L2_cache_size): the kind its name says, with its own SMs, shared memory, memory, L2."""
    arch = _CC_ARCH.get((props.major, props.minor))
    if arch is None:
        raise ValueError(
            f"mokgen builds kernels for Hopper (sm_90a); this GPU is {props.name} "
            f"(sm_{props.major}{props.minor}): to plan for another GPU name it, e.g. "
            f"gpu='h100-sxm' (kinds: {', '.join(k.lower() for k in KINDS)})")
    kind = kind_of(props.name, arch, props.multi_processor_count)
    optional = lambda attr, default: getattr(props, attr, 0) or default  # noqa: E731
    return with_sms(kind, props.multi_processor_count,
                    optional("shared_memory_per_block_optin", kind.smem_per_block),
                    smem_per_sm=optional("shared_memory_per_multiprocessor", kind.smem_per_sm),
                    l2_bytes=optional("L2_cache_size", kind.l2_bytes),
                    memory=props.total_memory or kind.memory, device=props.name)


@functools.lru_cache(maxsize=None)
def device(index: int) -> GPU:
    """CUDA device `index`'s GPU (from_properties), read once."""
    import torch

    return from_properties(torch.cuda.get_device_properties(index))


def current() -> GPU | None:
    """The current CUDA device's GPU, or None where torch sees no GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return device(torch.cuda.current_device())


_pinned: list = [None]


def set_default(gpu) -> GPU | None:
    """Pin the GPU plans target when a call names none (a kind name or a GPU; None: back to
    $MOKGEN_GPU / the current device / CPU_DEFAULT). Returns the pin it replaced."""
    old, _pinned[0] = _pinned[0], None if gpu is None else get(gpu)
    return old


def default() -> GPU:
    """The GPU a plan targets when the call names none (see the module's docstring)."""
    if _pinned[0] is not None:
        return _pinned[0]
    if CONFIG.gpu:
        return get(CONFIG.gpu)
    return current() or get(CPU_DEFAULT)


def target(gpu=None, arch: str | None = None) -> GPU:
    """The GPU a plan targets: `gpu` (a kind name or a GPU) if given, else the arch's (the
    current device where it has that arch, else the arch's reference kind; a kind name is
    taken as arch= too, as before gpu= existed), else `default()`."""
    if gpu is not None:
        g = get(gpu)
        if arch is not None and arch != g.arch:
            raise ValueError(f"arch must be {g.arch} (the arch of gpu {g.name}), got {arch!r}")
        return g
    if arch is None:
        return default()
    if arch not in ARCH_REFERENCE:
        try:
            return get(arch)  # a kind's name
        except ValueError:
            raise ValueError(f"arch must be one of {sorted(ARCH_REFERENCE)} (or name a GPU: "
                             f"gpu=, one of {sorted(k.lower() for k in KINDS)}), "
                             f"got {arch!r}") from None
    here = default()
    return here if here.arch == arch else KINDS[ARCH_REFERENCE[arch]]


@functools.lru_cache(maxsize=256)
def for_plan(name: str, num_sms: int, smem_per_block: int) -> GPU:
    """The GPU a plan was made for, from what it records: its kind's rates at its SM count
    and shared memory (the passes' numbers, again, for a plan read from JSON)."""
    kind = get(name)
    if (num_sms, smem_per_block) == (kind.num_sms, kind.smem_per_block):
        return kind
    return with_sms(kind, num_sms, smem_per_block)
