"""Plans from the device in hand (CPU): a GPU is read from the device's properties (faked
here: no GPU needed) and joined with its kind's rates; plans record it and are keyed by it;
every preset plans for a 132-, a 114- and a 78-SM Hopper with grids and SM partitions that
fit; the SM count moves only integer template parameters of the generated source, and a
representative few of those kernels compile without spills (nvcc-marked); the runtime
refuses a device other than the plan's; the memory report follows the card."""
import dataclasses
import re
import shutil
from types import SimpleNamespace

import pytest

import mokgen
from mokgen.compiler import codegen, hardware
from mokgen.compiler.passes.sm_partition import collective_sms
from test_limits import ep_over_one

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
KIB = 1024


def props(name: str, sms: int, memory_gib: float = 79.2, cc=(9, 0), smem=227 * KIB):
    """What torch.cuda.get_device_properties gives, for the fields hardware reads."""
    return SimpleNamespace(name=name, major=cc[0], minor=cc[1], multi_processor_count=sms,
                           total_memory=int(memory_gib * 2**30),
                           shared_memory_per_block_optin=smem,
                           shared_memory_per_multiprocessor=228 * KIB, L2_cache_size=50 << 20)


# the devices the issue names, as their drivers report them
DEVICES = {132: props("NVIDIA H100 80GB HBM3", 132), 114: props("NVIDIA H100 PCIe", 114),
           78: props("NVIDIA H20", 78, 95.6)}


@pytest.fixture
def on_device(monkeypatch):
    """Make hardware see a (fake) current device: plans made without gpu= target it."""
    def use(p):
        gpu = hardware.from_properties(p)
        monkeypatch.setattr(hardware, "current", lambda: gpu)
        monkeypatch.setattr(hardware, "_pinned", [None])
        return gpu
    return use


def test_devices_map_to_their_kinds():
    want = {"NVIDIA H100 80GB HBM3": ("H100-SXM", 132), "NVIDIA H100 PCIe": ("H100-PCIe", 114),
            "NVIDIA H20": ("H20", 78), "NVIDIA H200": ("H200", 132),
            "NVIDIA H800": ("H800", 132), "NVIDIA H200 NVL": ("H200", 132)}
    for name, (kind, sms) in want.items():
        g = hardware.from_properties(props(name, sms))
        assert (g.name, g.num_sms, g.device) == (kind, sms, name)
        assert g == dataclasses.replace(hardware.get(kind), memory=g.memory,
                                        l2_bytes=g.l2_bytes)  # its kind's rates
        assert g.memory == int(79.2 * 2**30)  # the device's own
    # a MIG slice: the kind's per-SM rates at its SMs; an unknown Hopper: the nearest kind
    mig = hardware.from_properties(props("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 60))
    assert (mig.name, mig.num_sms) == ("H100-SXM", 60)
    assert mig.bf16_flops / 60 == pytest.approx(hardware.H100_SXM.bf16_flops / 132)
    assert hardware.from_properties(props("NVIDIA Hopper X", 110)).name == "H100-PCIe"
    with pytest.raises(ValueError, match=r"A100.*sm_80.*gpu='h100-sxm'"):
        hardware.from_properties(props("NVIDIA A100-SXM4-80GB", 108, cc=(8, 0)))


def test_the_kinds_table():
    h100, h800, pcie, h20, h200 = (hardware.get(k) for k in
                                   ("h100-sxm", "H800", "h100_pcie", "h20", "h200"))
    assert hardware.get("H100") is h100 and hardware.get("sm_90a") is h200
    assert (h100.num_sms, pcie.num_sms, h20.num_sms) == (132, 114, 78)
    assert h200.measured and h100.measured and not any(g.measured for g in (h800, pcie, h20))
    assert h800.bf16_flops == h100.bf16_flops  # an H100 with less NVLink
    assert h800.nvlink_bw == 200e9 and h100.nvlink_bw == h200.nvlink_bw == 450e9
    assert h20.bf16_flops < pcie.bf16_flops < h100.bf16_flops  # H20: 148 TFLOP/s peak
    assert h100.hbm_bw < h200.hbm_bw and h100.memory < h20.memory < h200.memory
    # the reserve left to collectives follows the link: NCCL's CTAs cover one direction
    assert [collective_sms(g) for g in (h200, h100, h800, pcie, h20)] == [16, 16, 8, 2, 16]
    with pytest.raises(ValueError, match="gpu must be one of"):
        hardware.get("a100")


def test_plans_target_the_device_in_hand(on_device, monkeypatch):
    s = mokgen.shapes.get("qwen3-30b-a3b")
    on_device(DEVICES[114])
    p = mokgen.plan(s, ep=1, tokens_per_rank=4096)
    assert (p.gpu, p.gpu_sms, p.gpu_smem, p.num_sms) == ("H100-PCIe", 114, 227 * KIB, 114)
    assert "H100-PCIe sm_90a (114 SMs, 227 KiB" in str(p)
    # named: any machine plans for any kind; arch alone: the device, being one
    assert mokgen.plan(s, ep=1, tokens_per_rank=4096, gpu="h20").gpu_sms == 78
    assert mokgen.plan(s, ep=1, tokens_per_rank=4096, arch="sm_90a").gpu == "H100-PCIe"
    with pytest.raises(ValueError, match="arch must be sm_90a"):
        mokgen.plan(s, ep=1, gpu="h100-sxm", arch="sm_100a")
    # no GPU: $MOKGEN_GPU, else the CPU default (deterministic)
    monkeypatch.setattr(hardware, "current", lambda: None)
    assert mokgen.plan(s, ep=1).gpu == hardware.CPU_DEFAULT == "H200"
    monkeypatch.setattr(hardware, "CONFIG", dataclasses.replace(hardware.CONFIG, gpu="h800"))
    assert mokgen.plan(s, ep=1).gpu == "H800"


def test_the_gpu_is_in_the_plan_and_its_key(on_device):
    """A plan made on an H100 and one made anywhere for gpu="h100-sxm" are the same plan
    with the same key (kernels built ahead are found); other GPUs key other plans."""
    s = mokgen.shapes.get("kimi-k2.7")
    on_device(DEVICES[132])
    here = mokgen.plan(s, ep=64, tokens_per_rank=2048)
    named = mokgen.plan(s, ep=64, tokens_per_rank=2048, gpu="h100-sxm")
    assert here == named and here.key() == named.key() and here.forced == ()
    keys = {mokgen.plan(s, ep=64, tokens_per_rank=2048, gpu=g).key()
            for g in ("h100-sxm", "h200", "h800", "h100-pcie", "h20")}
    assert len(keys) == 5
    back = mokgen.Plan.from_json(here.to_json())
    assert back == here and back.target == here.target
    assert [k.source for k in codegen.emit(back)] == [k.source for k in codegen.emit(here)]
    # a plan saved before the GPU's fields: its kind's
    d = here.to_dict()
    d.update(gpu="H200")
    del d["gpu_sms"], d["gpu_smem"]
    import json

    old = mokgen.Plan.from_json(json.dumps(d))
    assert (old.gpu_sms, old.gpu_smem) == (132, 227 * KIB)


def cases():
    """(preset, ep, dtype): every preset at ep 1 and its largest ep <= 64 in bf16, the main
    presets in fp8 and MXFP8 too."""
    out = []
    for name in mokgen.shapes.names():
        e = mokgen.shapes.get(name).num_experts
        eps = sorted({1, ep_over_one(e)} if e > 1 else {1})
        out += [(name, ep, "bf16") for ep in eps]
        if name in mokgen.shapes.PRESETS_MAIN:
            out += [(name, eps[-1], d) for d in ("fp8", "mxfp8")]
    return out


# the template parameters the SM count may move (and the plan key): every other line of the
# generated source is the same for every GPU
SM_PARAMS = re.compile(r"/\*B\*/|/\*SLOTS\*/|/\*COMM\*/|_ctas = |C::COMM < |% 2 == 0 &&|"
                       r"MINIBATCH = |schedule_segments<|Generated by mokgen \(plan ")


@pytest.mark.parametrize("name,ep,dtype", cases())
def test_every_preset_plans_for_132_114_and_78_sms(name, ep, dtype, on_device):
    """Grids and partitions fit each device; the sources differ from the 132-SM ones only in
    the parameters the SM count sizes (so the 132-SM builds' no-spill checks carry over; the
    nvcc test below builds the farthest of them)."""
    s = mokgen.shapes.get(name)
    sources = {}
    for sms, dev in DEVICES.items():
        on_device(dev)
        plans = [mokgen.plan(s, ep=ep, dtype=dtype, tokens_per_rank=4096, overlap_comm=o)
                 for o in (False, True)]
        for p, overlap in zip(plans, (False, True)):
            assert p.gpu_sms == sms and p.num_sms == sms - p.reserve_sms
            assert p.reserve_sms == (collective_sms(p.target) if overlap else 0) <= sms // 2
            for c in (p.comm_sms_fwd, p.comm_sms_bwd):
                assert 0 <= c < p.num_sms and c <= p.num_sms // 2 + 2
        sources[sms] = {k.name.split("_")[0]: k.source.splitlines()
                        for k in codegen.emit(plans[0])}
    base = sources[132]
    for sms in (114, 78):
        assert sources[sms].keys() == base.keys()
        for unit, lines in sources[sms].items():
            assert len(lines) == len(base[unit]), (sms, unit)
            moved = [a for a, b in zip(lines, base[unit]) if a != b]
            assert all(SM_PARAMS.search(a) for a in moved), (sms, unit, moved)


# Built with nvcc (the CPU suite builds every preset for 132 SMs, test_compile_shapes): the
# 78-SM H20 moves every parameter the SM count sizes furthest from those (1 to 3 comm CTAs,
# other minibatches and ring slots), so its kernels are the representative ones: one rank
# bf16 (keep_h: prologue, forward, backward and its resident twin) and EP-64 fp8 (the peer
# paths and the fp8 tiles), plus EP-64 bf16 on the 114-SM H100 PCIe.
BUILT = [("qwen3-30b-a3b", 1, "bf16", 78), ("kimi-k2.7", 64, "fp8", 78),
         ("kimi-k2.7", 64, "bf16", 114)]


@pytest.mark.nvcc
@needs_nvcc
@pytest.mark.parametrize("name,ep,dtype,sms", BUILT)
def test_fewer_sms_compile_without_spills(name, ep, dtype, sms, on_device):
    from test_compile_shapes import assert_builds_clean, expected_units

    on_device(DEVICES[sms])
    layer = mokgen.compile(mokgen.shapes.get(name), ep=ep, dtype=dtype, tokens_per_rank=4096)
    assert layer.plan.gpu_sms == sms
    assert_builds_clean(layer, expected_units(layer.plan))  # no spills, no stack frame


def test_tuning_results_are_per_gpu(tmp_path, monkeypatch):
    """A `python -m mokgen tune` result is the GPU's it ran on: a plan for another GPU does
    not take it."""
    import json

    from mokgen.compiler import tuned

    monkeypatch.setattr(tuned, "CONFIG", dataclasses.replace(tuned.CONFIG, cache=tmp_path))
    shape = mokgen.shapes.get("gpu-small")
    path = tuned.tuned_file(shape, 2, "bf16", 512)
    assert ".h200." in path.name and path != tuned.tuned_file(shape, 2, "bf16", 512, gpu="h20")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"best": {"minibatch": 256, "comm_sms_fwd": 9}}))
    assert tuned.tuned_plan(shape, 2, "bf16", 512).is_forced("comm_sms_fwd")
    assert not tuned.tuned_plan(shape, 2, "bf16", 512, gpu="h20").is_forced("comm_sms_fwd")


def test_a_layer_for_another_gpu_is_refused_at_load(monkeypatch):
    """runtime/checks.py check_gpu: the device's SMs and shared memory against the plan's,
    both named (the CTA count compiled in is checked again when the cubin loads)."""
    import torch

    from mokgen.runtime.checks import check_gpu

    dev = {0: DEVICES[114]}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: dev[i])
    check_gpu("H100-PCIe", 114, 227 * KIB, 0)
    with pytest.raises(ValueError, match=r"planned for H100-SXM \(132 SMs, 227 KiB.*"
                                         r"NVIDIA H100 PCIe \(114 SMs, 227 KiB"):
        check_gpu("H100-SXM", 132, 227 * KIB, 0)
    dev[0] = props("NVIDIA H100 PCIe", 114, smem=99 * KIB)
    with pytest.raises(ValueError, match="99 KiB"):
        check_gpu("H100-PCIe", 114, 227 * KIB, 0)


def test_memory_report_follows_the_card():
    """Qwen3-30B-A3B at 8192 tokens, one rank: 1.2 GB of weights a layer, as many
    gradients; the card's memory bounds the stack (an 80 GB H100: about 28 layers)."""
    from mokgen.pytorch.api import max_layers, memory_report, stack_memory

    s = mokgen.shapes.get("qwen3-30b-a3b")
    reports = {g: memory_report(mokgen.plan(s, ep=1, tokens_per_rank=8192, gpu=g))
               for g in ("h100-sxm", "h200", "h20")}
    for g, r in reports.items():
        assert r["gpu"] == hardware.get(g).name and r["device_memory"] == hardware.get(g).memory
    fit = {g: r["max_layers"] for g, r in reports.items()}
    # the H200 trains 48 such layers (README's model stack) of ~50
    assert 20 <= fit["h100-sxm"] < fit["h20"] < fit["h200"] and 48 <= fit["h200"] < 60
    p = mokgen.plan(s, ep=1, tokens_per_rank=8192, gpu="h100-sxm")
    n = fit["h100-sxm"]
    usable = 0.94 * hardware.H100_SXM.memory
    assert stack_memory(p, n)["total"] <= usable < stack_memory(p, n + 1)["total"]
    m = stack_memory(p, n)
    assert m["weights"] == m["grads"] == n * (3 * 128 * 2048 * 768 * 2 + 128 * 2048 * 4)
    # checkpointing keeps only each layer's input: more layers fit
    assert max_layers(p, checkpointing=True) > n
    assert max_layers(p, memory=2**30) == 0


@pytest.mark.nvcc
@needs_nvcc
def test_the_probe_builds_and_prints_an_entry_to_paste():
    """mokgen.harness.probe (run on the GPU): its kernels build without spills; its entry is
    Python that gives the kind's GPU with the measured rates."""
    from mokgen.compiler import build
    from mokgen.harness import probe

    (b,) = build.build([build.Kernel("probe", probe.KERNELS)])
    assert set(b.resources) == {"probe_copy", "probe_pingpong"} and b.spills == 0
    rates = dict(bf16_flops=712e12, fp8_flops=1.31e15, hbm_bw=2.95e12, copy_bw_per_sm=38e9,
                 flag_latency=8.1e-7)
    text = probe.entry({"device": "NVIDIA H100 80GB HBM3", "kind": "H100-SXM", "num_sms": 132,
                        "torch": "2.x", "measured": rates})
    assert "bf16_flops=712e12" in text and "flag_latency=8.1e-07" in text
    ns = {"GPU": hardware.GPU}
    exec(text, ns)
    assert ns["H100_SXM"] == dataclasses.replace(hardware.H100_SXM, **rates, measured=True)


@pytest.mark.gpu
def test_on_the_gpu_plans_are_for_it_and_others_are_refused():
    """The device in hand: its kind, SMs and memory; a layer planned for a GPU of other SMs
    is refused before anything loads."""
    import torch

    from mokgen.pytorch.api import CompiledMoE

    here = torch.cuda.get_device_properties(torch.cuda.current_device())
    gpu = hardware.current()
    assert (gpu.num_sms, gpu.memory, gpu.device) == (here.multi_processor_count,
                                                     here.total_memory, here.name)
    s = mokgen.shapes.get("gpu-small")
    p = mokgen.plan(s, ep=1, tokens_per_rank=256)
    assert (p.gpu, p.gpu_sms, p.num_sms) == (gpu.name, gpu.num_sms, gpu.num_sms)
    other = "h20" if gpu.num_sms != 78 else "h100-sxm"
    q = mokgen.plan(s, ep=1, tokens_per_rank=256, gpu=other)
    with pytest.raises(ValueError, match=rf"planned for {q.gpu} \({q.gpu_sms} SMs.*"
                                         rf"\({gpu.num_sms} SMs"):
        CompiledMoE(q, {}, virtual=True, build_seconds=0.0).runtime()
