"""The host <-> device interface has one description (runtime/abi.py): the host packs by field
name, and the generated sources assert the headers' layout against it (a drift fails nvcc)."""
import shutil
import subprocess

import pytest

from mokgen.compiler import codegen
from mokgen.compiler.build import INCLUDE_DIR
from mokgen.runtime import abi


def test_pack_by_name_refuses_missing_and_unknown_fields():
    fields = (("a", "ptr"), ("n", "i32"), ("m", "i32"))
    assert abi.layout(fields) == ({"a": 0, "n": 8, "m": 12}, 16)
    assert abi.layout((("a", "ptr"), ("n", "i32")))[1] == 16  # padded to the pointer
    assert abi.pack(fields, a=None, n=1, m=2) == bytes(8) + (1).to_bytes(4, "little") + (
        2).to_bytes(4, "little")
    with pytest.raises(ValueError, match="missing \\['m'\\]"):
        abi.pack(fields, a=0, n=1)
    with pytest.raises(ValueError, match="unknown \\['x'\\]"):
        abi.pack(fields, a=0, n=1, m=2, x=3)
    with pytest.raises(ValueError, match="tensor maps missing"):
        abi.pack_maps(("p", "q"), {"p": 1}, lambda m: bytes(128))


def test_every_struct_packs_each_field_at_its_layout_offset():
    """pack puts every value where `layout` says (the offsets the headers are checked
    against), padding zero, for each struct the runtime packs."""
    import random
    import struct

    rng = random.Random(0)
    structs = [v for k, v in vars(abi).items() if k.isupper() and isinstance(v, tuple) and v
               and all(isinstance(f, tuple) and len(f) == 2 and f[1] in abi._FORMAT for f in v)]
    assert abi.FWD_BUFFERS in structs and abi.BWD_BUFFERS in structs
    draw = {"ptr": lambda: rng.getrandbits(64), "u64": lambda: rng.getrandbits(64),
            "i32": lambda: rng.randrange(-2**31, 2**31)}
    for fields in structs:
        values = {name: draw[kind]() for name, kind in fields}
        offsets, size = abi.layout(fields)
        want = bytearray(size)
        for name, kind in fields:
            struct.pack_into(f"<{abi._FORMAT[kind]}", want, offsets[name], values[name])
        assert abi.pack(fields, **values) == bytes(want), fields[0]


def test_every_phase_has_a_message_and_unique_number():
    values = [v for v, _ in abi.PHASES.values()] + [abi.BARRIER_PHASE[0]]
    assert len(values) == len(set(values))
    assert abi.phase_text(2).startswith("a gate/up tile") and abi.phase_text(77) == "phase 77"


def _compile(unit: str, checks: str, tmp_path):
    header = {"fwd": "moe_fwd.cuh", "bwd": "moe_bwd.cuh"}[unit]
    src = tmp_path / f"{unit}.cu"
    src.write_text(f'#include <cstddef>\n#include "mokgen/{header}"\n{checks}\n')
    return subprocess.run(["nvcc", "-std=c++17", "--expt-relaxed-constexpr",
                           "-gencode=arch=compute_90a,code=sm_90a", "-cubin", str(src), "-o",
                           str(tmp_path / f"{unit}.cubin"), f"-I{INCLUDE_DIR}"],
                          capture_output=True, text=True)


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_headers_match_the_description_and_a_drift_fails_the_build(tmp_path, monkeypatch):
    for unit in ("fwd", "bwd"):
        r = _compile(unit, codegen.abi_checks(unit), tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
    swapped = list(abi.FWD_BUFFERS)
    swapped[0], swapped[1] = swapped[1], swapped[0]  # host would pack row_weight first
    monkeypatch.setitem(abi.STRUCTS, "FwdBuffers", tuple(swapped))
    r = _compile("fwd", codegen.abi_checks("fwd"), tmp_path)
    assert r.returncode != 0 and "FwdBuffers.row_weight drifted" in r.stderr


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_fp8_padded_widths_agree_with_the_header_and_a_drift_fails_the_build(tmp_path,
                                                                               monkeypatch):
    """The fp8 weights' padded widths are computed by the host (abi.padded, which lays the
    weights out) and by the header (FwdConsts::PD / PI, which indexes them): the sources
    assert them equal. 2880 and 720 are not multiples of 128, so the two sides differ unless
    both pad."""
    import mokgen
    plan = mokgen.plan(mokgen.MoEShape(8, 2880, 720, 2, shared_experts=0), ep=1, dtype="fp8",
                       tokens_per_rank=256)

    def checks():  # the generated source's FwdConsts and its padded-width assertion
        src = codegen.emit(plan, units=("fwd",))[0].source
        inst = src[src.index("using C = "):src.index(";", src.index("using C = ")) + 1]
        start = src.index("static_assert(C::PD ==")
        return f"{inst}\n{src[start:src.index(');', start) + 2]}"

    c = codegen.constants(plan)["fwd"]
    assert (c["padded_hidden"], c["padded_intermediate"]) == (2944, 768)
    r = _compile("fwd", checks(), tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    monkeypatch.setattr(abi, "padded", lambda n: -(-n // 64) * 64)  # a host padding to 64
    r = _compile("fwd", checks(), tmp_path)
    assert r.returncode != 0 and "padded widths drifted" in r.stderr
