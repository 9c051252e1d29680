"""Rendering, the build cache, and nvcc compiles of the generated kernels (CPU; needs nvcc)."""
import dataclasses
import hashlib
import json
import multiprocessing as mp
import shutil
import subprocess

import pytest

import mokgen
from mokgen.compiler import build, codegen, limits
from mokgen.runtime import abi

import race_build
from conftest import assert_spills_within_known

PRESETS = ("kimi-k2.7", "glm-5.2", "qwen3.5-397b-a17b", "deepseek-v4-pro")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


def test_render_instantiates_plan_constants():
    p = mokgen.plan(mokgen.shapes.get("qwen3.5-397b-a17b"), ep=64, tokens_per_rank=1024)
    fwd = dict((k.name.split("_")[0], k) for k in codegen.emit(p))["fwd"].source
    assert "/*D*/ 4096" in fwd and "/*I*/ 1024" in fwd and "/*R*/ 64" in fwd
    assert f"/*B*/ {p.minibatch}" in fwd and f"/*SLOTS*/ {p.ring_slots}" in fwd
    assert f"/*COMM*/ {p.comm_sms_fwd}" in fwd and p.key() in fwd


def test_unsupported_plans_are_refused_by_the_planner_and_by_emit():
    s = mokgen.shapes.get("glm-5.2")
    with pytest.raises(ValueError, match="reverse_combine='gather' needs ep == 1"):
        mokgen.plan(s, ep=8, dtype="fp8", reverse_combine="gather")
    with pytest.raises(ValueError, match="hidden must be a multiple of 16"):
        mokgen.plan(mokgen.MoEShape(8, 2888, 2880, 2), ep=2, dtype="mxfp8")
    # a plan that skipped the planner's check (built by hand, read from JSON) is refused too
    bad = mokgen.plan(s, ep=8, dtype="fp8").replace(shape=mokgen.MoEShape(256, 6144, 2008, 8))
    with pytest.raises(ValueError, match="intermediate must be a multiple of 16"):
        codegen.emit(bad)


def test_parse_ptxas_report():
    text = """ptxas info    : Compiling entry function 'k1' for 'sm_90a'
ptxas info    : Function properties for k1
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 2 barriers, 1024 bytes smem"""
    r = build.parse_ptxas(text)["k1"]
    assert r == dict(registers=168, smem=1024, stack=8, spill_stores=4, spill_loads=12,
                     wgmma_serialized=0)
    # every C751x reason (the register one went unseen by a check for C7512 alone)
    for code, why in (("C7511", "insufficient register resources for the wgmma pipeline"),
                      ("C7512", "the presence of Extern calls")):
        note = (f"ptxas info    : ({code}) Potential Performance Loss: wgmma.mma_async "
                f"instructions are serialized due to {why} in the function 'k1'")
        got = build.parse_ptxas(text + "\n" + note)
        assert got["k1"]["wgmma_serialized"] == 1 and got["k1"]["registers"] == 168, code
    # a device function ptxas kept as a call reports after its kernel: its own line, not
    # the kernel's (the kernel's spills were overwritten with the callee's zeros)
    callee = """ptxas info    : Function properties for _ZN6mokgen13bwd_comm_joinEv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"""
    got = build.parse_ptxas(text + "\n" + callee)
    assert got["k1"]["spill_stores"] == 4 and got["k1"]["spill_loads"] == 12
    assert got["_ZN6mokgen13bwd_comm_joinEv"]["spill_stores"] == 0


@needs_nvcc
def test_a_serialized_kernel_is_reported_and_warned(tmp_path, monkeypatch):
    """A cached kernel whose ptxas report has a C751x note, cached before resources had the
    field: build() reads the report again, the Binary names the function and the user who
    compiles it is warned (the kernel is correct, only slow)."""
    monkeypatch.setattr(build, "CONFIG", dataclasses.replace(build.CONFIG, cache=tmp_path))
    k = build.Kernel("serial_probe", "int a;")
    folder = build._folder(k, build.cache_key(k, "sm_90a"))
    folder.mkdir(parents=True)
    image = b"a cubin's bytes"
    (folder / "kernel.cubin").write_bytes(image)
    (folder / "ptxas.txt").write_text(
        "ptxas info    : Compiling entry function 'k1' for 'sm_90a'\n"
        "ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to insufficient register resources for the wgmma pipeline in the "
        "function 'k1'\n")
    (folder / "meta.json").write_text(json.dumps(dict(
        cubin_sha256=hashlib.sha256(image).hexdigest(), build_seconds=0.0,
        resources={"k1": dict(registers=168, smem=0, stack=0, spill_stores=0, spill_loads=0)})))
    with pytest.warns(RuntimeWarning, match="serialized the wgmma instructions of k1"):
        (b,) = build.build([k])
    assert b.cached and b.serialized == ["k1"]


@needs_nvcc
def test_cache_key_tracks_source_flags_and_arch():
    k = build.Kernel("x", "int a;")
    assert build.cache_key(k, "sm_90a") == build.cache_key(build.Kernel("x", "int a;"), "sm_90a")
    assert build.cache_key(k, "sm_90a") != build.cache_key(build.Kernel("x", "int b;"), "sm_90a")
    assert build.cache_key(k, "sm_90a") != build.cache_key(build.Kernel("x", "int a;", ("-G",)),
                                                         "sm_90a")
    assert build.cache_key(k, "sm_90a") != build.cache_key(k, "sm_100a")


@needs_nvcc
def test_concurrent_builds_share_one_binary(tmp_path):
    """Eight ranks building the same kernel at once: one compiles it (its lock held), the
    others wait and load that one binary."""
    with mp.get_context("spawn").Pool(8) as pool:  # 8 ranks compiling the same kernel
        paths, cached = zip(*pool.map(race_build.build_in, [str(tmp_path)] * 8))
    assert len(set(paths)) == 1
    assert sorted(cached) == [False] + [True] * 7, "built by exactly one rank"
    folders = [p for p in tmp_path.iterdir() if p.name.startswith("kernel.race.")]
    assert len(folders) == 1 and (folders[0] / "kernel.cubin").stat().st_size > 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("build.")], "temp dirs left"
    meta = json.loads((folders[0] / "meta.json").read_text())
    assert "k" in meta["resources"]


@needs_nvcc
@pytest.mark.parametrize("name", PRESETS)
def test_preset_kernels_compile_without_spills(name):
    """Forward, backward and prologue of each preset: sm_90a, no spills, no stack."""
    p = mokgen.plan(mokgen.shapes.get(name), ep=64, tokens_per_rank=2048)
    layer = mokgen.compile(mokgen.shapes.get(name), ep=64, tokens_per_rank=2048)
    assert layer.plan == p
    for unit, b in layer.binaries.items():
        assert b.path.exists()
        for fn, r in b.resources.items():
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (unit, fn, r)
            assert r["stack"] == 0, (unit, fn, r)
        assert not b.serialized, (unit, b.serialized)
    fwd, bwd = layer.binaries["fwd"], layer.binaries["bwd"]
    assert fwd.resources["mokgen_fwd"]["registers"] <= 168
    assert bwd.resources["mokgen_bwd"]["registers"] <= 168
    cuobjdump = _cuobjdump()
    if cuobjdump:  # the SASS check runs wherever a disassembler exists (triton ships one)
        sass = [subprocess.run([cuobjdump, "-sass", str(b.path)], capture_output=True,
                               text=True).stdout for b in (fwd, bwd)]
        assert "HGMMA.64x256x16.F32.BF16" in sass[0] and "UTMALDG" in sass[0]
        # the backward's three operand layouts: K-major, B MN-major (dgrad), both (dW)
        for form in ("gdesc[UR", ".tnspB", ".tnspA.tnspB"):
            assert form in sass[1], form
        assert_narrow_tiles_where_edges(mokgen.shapes.get(name), sass)


@needs_nvcc
@pytest.mark.parametrize("dtype", ["fp8", "mxfp8"])
@pytest.mark.parametrize("name", PRESETS)
def test_fp8_kernels_compile_without_spills(name, dtype):
    """The fp8 forward and backward (and the prologue with the source-side quantizer) for
    each preset: no spills, no stack, no serialized wgmma; the routed GEMMs (the backward's
    replay, dgrad and dx) run as QGMMA (e4m3) and the shared expert's (and the weight
    gradients) as HGMMA (bf16) in the same kernels."""
    layer = mokgen.compile(mokgen.shapes.get(name), ep=64, dtype=dtype, tokens_per_rank=2048)
    assert_no_spills_nor_serialized_wgmma(layer)
    assert "mokgen_quant_x" in layer.binaries["prologue"].resources
    cuobjdump = _cuobjdump()
    if cuobjdump:
        for unit in ("fwd", "bwd"):
            sass = subprocess.run([cuobjdump, "-sass", str(layer.binaries[unit].path)],
                                  capture_output=True, text=True).stdout
            assert "QGMMA.64x128x32.F32.E4M3.E4M3" in sass, unit
            assert "HGMMA.64x256x16.F32.BF16" in sass, unit


# Multicast pairs (GemmConfig.pair, the forward's): a whole layer at ep 1 (Qwen3-30B-A3B), a
# slice with a shared expert (kimi ep 8: its gate/up and down pairs), widths ending in edge
# tiles and a K tail (gpt-oss-20b, 2880).
PAIRS = {"qwen3-30b-a3b": (1, 8192), "kimi-k2.7": (8, 2048), "gpt-oss-20b": (1, 4096)}


@needs_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("name", PAIRS)
def test_pair_forward_compiles_without_spills(name):
    """The forward in multicast pairs: no spill, no stack, no serialized wgmma; its SASS has
    the multicast weight loads, the mailbox's st.async and the cluster barrier."""
    ep, n = PAIRS[name]
    layer = mokgen.compile(mokgen.shapes.get(name), ep=ep, tokens_per_rank=n,
                           gemm_fwd=(128, 256, 4, True))
    assert_no_spills_nor_serialized_wgmma(layer)
    cuobjdump = _cuobjdump()
    if cuobjdump:
        sass = subprocess.run([cuobjdump, "-sass", str(layer.binaries["fwd"].path)],
                              capture_output=True, text=True).stdout
        for op in ("UTMALDG.2D.MULTICAST", "STAS", "UCGABAR_WAIT", "HGMMA.64x256x16.F32.BF16"):
            assert op in sass, op


# The backward with an x window (passes/x_window.py: the forward gathers x, the backward's x
# ring is a few minibatch slots, dW1's x rows wrap in it): Qwen3-30B (5 slots of 23),
# Mixtral-8x7B (few large experts, a wide window), gpt-oss-20b (2880: K and edge tails).
@needs_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("name,tokens", [("qwen3-30b-a3b", 8192), ("mixtral-8x7b", 8192),
                                         ("gpt-oss-20b", 4096)])
def test_x_window_backward_compiles_without_spills(name, tokens):
    layer = mokgen.compile(mokgen.shapes.get(name), ep=1, tokens_per_rank=tokens,
                           dispatch="gather", reverse_combine="pull")
    p = layer.plan
    assert p.x_slots is not None and p.x_slots < p.ring_slots
    assert_no_spills_nor_serialized_wgmma(layer)


# keep_h (each call keeps its h; the backward pulls x after a copying forward): the XPULL
# backward on the default plan's minibatch and ring, and DeepSeek-V2-Lite's shared expert and
# 1408 edge tiles.
@needs_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("name,tokens", [("qwen3-30b-a3b", 8192), ("deepseek-v2-lite", 4096)])
def test_keep_h_backward_compiles_without_spills(name, tokens):
    layer = mokgen.compile(mokgen.shapes.get(name), ep=1, tokens_per_rank=tokens, keep_h=True)
    assert layer.plan.keep_h
    assert_no_spills_nor_serialized_wgmma(layer)


@pytest.mark.parametrize("name,tokens", [("qwen3-30b-a3b", 8192), ("deepseek-v2-lite", 4096)])
def test_keep_h_plans_add_the_default_backward_for_resident_calls(name, tokens):
    """keep_h is the default at ep 1 in bf16 (the ring holds every minibatch: passes/keep_h.py).
    A keep_h plan emits a second backward ("bwdres", plan.resident_twin) for calls whose
    ring still holds their own forward: the default plan's backward source, save the plan key
    in its first line, with the default plan's (smaller) backward comm CTA count; its own
    backward pulls x (XPULL) with more. Other plans emit no second backward; a forced
    comm_sms_bwd stays forced in the twin."""
    from mokgen.compiler.planner import resident_twin

    shape = mokgen.shapes.get(name)
    kh = mokgen.plan(shape, ep=1, tokens_per_rank=tokens)
    assert kh.keep_h and kh.comm_sms_bwd == mokgen.plan(shape, ep=1, tokens_per_rank=tokens,
                                                        keep_h=True).comm_sms_bwd
    default = mokgen.plan(shape, ep=1, tokens_per_rank=tokens, keep_h=False)
    src = {k.name.split("_")[0]: k.source for k in codegen.emit(kh)}
    assert set(src) == {"prologue", "fwd", "bwd", "bwdres"}
    want = next(k.source for k in codegen.emit(default, ("bwd",)))
    assert src["bwdres"].split("\n")[1:] == want.split("\n")[1:]
    assert src["bwd"] != src["bwdres"]
    twin = resident_twin(kh)
    assert not twin.keep_h and twin.comm_sms_bwd == default.comm_sms_bwd < kh.comm_sms_bwd
    assert resident_twin(default) is None
    assert {k.name.split("_")[0] for k in codegen.emit(default)} == {"prologue", "fwd", "bwd"}
    forced = mokgen.plan(shape, ep=1, tokens_per_rank=tokens, comm_sms_bwd=10)
    assert forced.keep_h and forced.comm_sms_bwd == 10
    assert resident_twin(forced).comm_sms_bwd == 10


def _cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import os

        import triton

        cand = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        return cand if os.path.exists(cand) else None
    except ImportError:
        return None


# Widths that are odd multiples of 128, whose 256-wide tiles end in a masked edge tile:
# DeepSeek-V2-Lite's intermediate 1408 (dgrad, dW2), and every width odd (the forward's down
# tiles, dx, dW1 and the shared expert's too). tests/test_gpu_widths.py runs them.
WIDTHS_128 = {"v2lite": mokgen.MoEShape(16, 2048, 1408, 6, shared_intermediate=2816),
              "odd128": mokgen.MoEShape(8, 1152, 640, 2, shared_intermediate=384)}


def test_128_multiple_widths_have_a_backward():
    for shape in WIDTHS_128.values():
        p = mokgen.plan(shape, ep=2, tokens_per_rank=512)
        assert codegen.backward_unsupported(p) is None
        assert {k.name.split("_")[0] for k in codegen.emit(p)} == {"prologue", "fwd", "bwd"}


@needs_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("dtype", ["bf16", "fp8", "mxfp8"])
@pytest.mark.parametrize("name", WIDTHS_128)
def test_128_multiple_widths_compile_without_spills(name, dtype):
    """Forward and backward for widths that are multiples of 128 but not 256: no spills, no
    stack, no serialized wgmma."""
    layer = mokgen.compile(WIDTHS_128[name], ep=2, dtype=dtype, tokens_per_rank=512)
    assert set(layer.binaries) == {"prologue", "fwd", "bwd"}
    assert_no_spills_nor_serialized_wgmma(layer)
    cuobjdump = _cuobjdump()
    if cuobjdump and dtype == "bf16":  # (fp8 tiles run 128-wide halves either way)
        sass = [subprocess.run([cuobjdump, "-sass", str(layer.binaries[u].path)],
                               capture_output=True, text=True).stdout for u in ("fwd", "bwd")]
        assert_narrow_tiles_where_edges(WIDTHS_128[name], sass)


def assert_narrow_tiles_where_edges(shape, sass):
    """A bf16 kernel compiles the narrow (N = 128) mainloop exactly where one of its 256-wide
    output tilings ends with at most 128 columns (gemm_tile.cuh half_edge): the forward's
    down tiles across D; the backward's across D, I and the shared width."""
    def edge(w):
        return 0 < w % 256 <= 128
    shared = shape.shared_dim if shape.shared_experts else 0
    want = (edge(shape.hidden),
            edge(shape.hidden) or edge(shape.intermediate) or (shared > 0 and edge(shared)))
    for unit, text, narrow in zip(("fwd", "bwd"), sass, want):
        assert ("HGMMA.64x128x16.F32.BF16" in text) == narrow, (unit, shape)


def assert_no_spills_nor_serialized_wgmma(layer):
    """Every kernel of the layer: no spill, no stack frame, no wgmma serialized by ptxas (any
    of its C751x reasons: build.parse_ptxas)."""
    for unit, b in layer.binaries.items():
        for fn, r in b.resources.items():
            assert_spills_within_known(layer, unit, fn, r)
        assert not b.serialized, f"{unit}: wgmma serialized in {b.serialized}"


# Widths that are multiples of 8 but not of the tiles (bf16; the fp8 tiles' hidden and
# intermediate are multiples of 16: WIDTHS_16 below; the bf16 shared expert of an fp8 plan any
# multiple of 8): K tails (1040 = 16 x 65), gate/up edge tiles of 80 / 64 columns, down edge
# tiles of 16 / 64 columns, weight-gradient edge rows; gpt-oss-20b's hidden = intermediate =
# 2880.
WIDTHS_8 = {"tail16": (mokgen.MoEShape(8, 1040, 720, 2, shared_intermediate=336), "bf16"),
            "tail8": (mokgen.MoEShape(8, 1032, 712, 2, shared_intermediate=328), "bf16"),
            "gpt-oss": (mokgen.MoEShape(8, 2880, 2880, 4, shared_experts=0), "bf16"),
            "fp8-shared-tail": (mokgen.MoEShape(8, 1152, 640, 2, shared_intermediate=336),
                                "fp8"),
            "mxfp8-shared-tail": (mokgen.MoEShape(8, 1152, 640, 2, shared_intermediate=336),
                                  "mxfp8")}


def test_width_rules():
    """mokgen.compiler.limits is the one statement of the kernels' width rules."""
    ok = mokgen.plan(mokgen.MoEShape(8, 1032, 712, 2, shared_intermediate=328), ep=2)
    limits.check(ok)
    assert codegen.backward_unsupported(ok) is None
    with pytest.raises(ValueError, match="intermediate must be a multiple of 16.*mxfp8"):
        codegen.emit(mokgen.plan(mokgen.MoEShape(8, 1024, 808, 2), ep=2, dtype="mxfp8"))
    codegen.emit(mokgen.plan(mokgen.MoEShape(8, 1024, 800, 2), ep=2, dtype="mxfp8"))
    limits.check(mokgen.plan(mokgen.MoEShape(8, 1024, 768, 2, shared_intermediate=336), ep=2,
                             dtype="mxfp8"))


@needs_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("name", WIDTHS_8)
def test_8_multiple_widths_compile_without_spills(name):
    shape, dtype = WIDTHS_8[name]
    layer = mokgen.compile(shape, ep=2, dtype=dtype, tokens_per_rank=512)
    assert set(layer.binaries) == {"prologue", "fwd", "bwd"}
    assert_no_spills_nor_serialized_wgmma(layer)


def test_profile_is_a_plan_decision_that_reaches_the_source():
    """Profiling variants are a plan option rendered into the GEMM configuration (no #ifdefs
    in the headers); unknown names are refused; the table says the build is for timing."""
    s = mokgen.shapes.get("gpu-small")
    base = mokgen.plan(s, ep=2, tokens_per_rank=256)
    prof = mokgen.plan(s, ep=2, tokens_per_rank=256, profile=["no_routed_wgrad", "no_dh_quant"])
    assert prof.profile == ("no_dh_quant", "no_routed_wgrad") and prof.key() != base.key()
    assert "PROFILING BUILD" in str(prof) and "PROFILING BUILD" not in str(base)
    src = {k.name.split("_")[0]: k.source for k in codegen.emit(prof)}
    assert "/*PROF*/ 3," in src["bwd"] and "/*PROF*/ 0," in codegen.emit(base)[2].source
    with pytest.raises(ValueError, match="profile must be a tuple of"):
        mokgen.plan(s, ep=2, profile=("faster",))
    for header in (build.INCLUDE_DIR / "mokgen").glob("*.cuh"):
        assert "MOKGEN_PROFILE" not in header.read_text(), header.name


@needs_nvcc
@pytest.mark.nvcc
def test_profile_variants_compile():
    layer = mokgen.compile(mokgen.shapes.get("gpu-small"), ep=2, dtype="fp8",
                           tokens_per_rank=256, profile=tuple(abi.PROFILES))
    assert set(layer.binaries) == {"prologue", "fwd", "bwd"}
    assert_no_spills_nor_serialized_wgmma(layer)
    # the gathered producer's profiles reach only gathered plans (one rank, bf16); no_mma its
    # bf16 mainloops
    gathered = ("gather_in_order", "gather_no_fence", "gather_one_waiter", "no_mma")
    layer = mokgen.compile(mokgen.shapes.get("gpu-small"), ep=1, tokens_per_rank=256,
                           dispatch="gather", profile=gathered)
    src = {k.name.split("_")[0]: k.source for k in codegen.emit(layer.plan)}
    assert f"/*PROF*/ {abi.profile_mask(gathered)}," in src["bwd"]
    assert_no_spills_nor_serialized_wgmma(layer)


# fp8 and MXFP8 at widths that are multiples of 16 but not of 128 (issue #16): partial scale
# blocks along K (zero-padded), gate/up edge tiles of 64 / 16 / 80 columns, dgrad / dx / down
# edge tiles whose second 128-column B half is absent (16, 64) or partial (720 = 2 x 256 + 208);
# the weights padded per expert to whole 128-blocks. tests/test_gpu_widths.py runs them.
WIDTHS_16 = {"gpt-oss": mokgen.MoEShape(8, 2880, 2880, 4, shared_experts=0),
             "fp8-16": mokgen.MoEShape(8, 2048 + 16, 768 + 16, 2, shared_intermediate=336),
             "tail16": mokgen.MoEShape(8, 1040, 720, 2, shared_intermediate=336)}


@needs_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("dtype", ["fp8", "mxfp8"])
@pytest.mark.parametrize("name", WIDTHS_16)
def test_16_multiple_fp8_widths_compile_without_spills(name, dtype):
    layer = mokgen.compile(WIDTHS_16[name], ep=2, dtype=dtype, tokens_per_rank=512)
    assert set(layer.binaries) == {"prologue", "fwd", "bwd"}
    assert_no_spills_nor_serialized_wgmma(layer)


@needs_nvcc
@pytest.mark.nvcc
def test_engine_test_kernels_compile(tmp_path):
    """gemm_test.cu (the engine's standalone kernels, which the GPU tests load) still builds
    against the engine's Problem interface, with no local memory: a new Problem member the
    engine asks for must reach it too."""
    import os
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    inc = os.path.join(root, "mokgen/runtime/include")
    cubin = str(tmp_path / "gemm_test.cubin")
    res = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17",
                          "-cubin", "-Xptxas", "-v", "-I", inc,
                          os.path.join(root, "tests/cuda/gemm_test.cu"), "-o", cubin],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "bytes spill" in res.stderr
    for line in res.stderr.splitlines():
        if "bytes spill" in line:
            assert "0 bytes spill stores, 0 bytes spill loads" in line, line
