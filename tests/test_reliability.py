"""Bad input at every public entry, and the build cache's integrity (CPU; nvcc for the cache)."""
import shutil

import pytest
import torch

import mokgen
from mokgen.compiler import build

from conftest import kernels_not_built

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
SHAPE = mokgen.shapes.get("gpu-small")  # E=32 D=1024 I=512 k=4, one shared expert
R, N = 2, 64
L, D, I, E = SHAPE.num_experts // R, SHAPE.hidden, SHAPE.intermediate, SHAPE.num_experts


@pytest.fixture(scope="module")
def layer():
    """The layer mokgen.compile returns, its kernels unbuilt: every bad call is refused
    before any kernel would run."""
    with kernels_not_built():
        return mokgen.compile(SHAPE, ep=R, tokens_per_rank=N, virtual=True)


def good(n=N):
    bf = torch.bfloat16
    return dict(x=[torch.randn(n, D).to(bf) for _ in range(R)],
                router_logits=[torch.randn(n, E) for _ in range(R)],
                w1=[torch.randn(L, 2 * I, D).to(bf) for _ in range(R)],
                w2=[torch.randn(L, D, I).to(bf) for _ in range(R)],
                shared_w1=torch.randn(2 * I, D).to(bf), shared_w2=torch.randn(D, I).to(bf))


def with_(key, fn):
    def make():
        args = good()
        args[key] = fn(args[key])
        return args
    return make


BAD_CALLS = [
    ("x-dtype", with_("x", lambda v: [t.float() for t in v]), TypeError, r"x\[0\].*dtype"),
    ("x-shape", with_("x", lambda v: [t[:, :-16] for t in v]), ValueError, r"x\[0\].*shape"),
    ("x-not-list", with_("x", lambda v: v[0]), TypeError, r"x must be a list"),
    ("x-ranks", with_("x", lambda v: v[:1]), ValueError, r"x must be a list of 2"),
    ("x-too-many-tokens", lambda: good(N + 1), ValueError, r"tokens_per_rank=64"),
    ("x-not-tensor", with_("x", lambda v: [t.tolist() for t in v]), TypeError, r"x must be a torch"),
    ("logits-dtype", with_("router_logits", lambda v: [t.long() for t in v]), TypeError,
     r"router_logits\[0\].*dtype"),
    ("logits-shape", with_("router_logits", lambda v: [t[:, :-1] for t in v]), ValueError,
     r"router_logits\[0\].*shape"),
    ("w1-shape", with_("w1", lambda v: [t[:-1] for t in v]), ValueError, r"w1\[0\].*shape"),
    ("w2-strided", with_("w2", lambda v: [t.transpose(1, 2).contiguous().transpose(1, 2)
                                          for t in v]), ValueError, r"w2\[0\].*contiguous"),
    ("w2-ranks", with_("w2", lambda v: v + v), ValueError, r"w2 must be a list of 2"),
    ("shared-missing", with_("shared_w1", lambda v: None), TypeError, r"shared_w1"),
    ("shared-shape", with_("shared_w2", lambda v: v[:, :-8]), ValueError, r"shared_w2.*shape"),
    ("cpu-device", good, ValueError, r"x\[0\] must be on a CUDA device"),
]


@pytest.mark.parametrize("case,make,exc,match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_callable_rejects_bad_input(layer, case, make, exc, match):
    with pytest.raises(exc, match=match):
        layer(**make())


def test_shared_weights_refused_for_a_shape_without_shared_expert():
    shape = mokgen.MoEShape(16, 512, 256, 2, shared_experts=0)
    with kernels_not_built():
        lay = mokgen.compile(shape, ep=1, tokens_per_rank=8)
    bf = torch.bfloat16
    with pytest.raises(ValueError, match="no shared expert"):
        lay(torch.randn(8, 512).to(bf), torch.randn(8, 16), torch.randn(16, 512, 512).to(bf),
            torch.randn(16, 512, 256).to(bf), torch.randn(512, 512).to(bf), None)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(ep=3), ValueError, "ep must divide num_experts"),
    (dict(ep=0), ValueError, "ep must be a positive int"),
    (dict(dtype="fp16"), ValueError, "dtype must be one of"),
    (dict(tokens_per_rank=0), ValueError, "tokens_per_rank"),
    (dict(tokens_per_rank=2.5), ValueError, "tokens_per_rank"),
    (dict(watchdog_s=0), ValueError, "watchdog_s"),
    (dict(minibatch=100), ValueError, "minibatch"),
])
def test_compile_rejects_bad_arguments(kw, exc, match):
    args = dict(ep=2, tokens_per_rank=64) | kw
    with pytest.raises(exc, match=match):
        mokgen.compile(SHAPE, **args)


def test_compile_rejects_unsupported_sizes():
    with pytest.raises(ValueError, match="hidden must be a multiple of 16.*mxfp8"):
        mokgen.compile(mokgen.MoEShape(8, 64 * 3 + 8, 128, 2), ep=1, tokens_per_rank=8,
                       dtype="mxfp8")


# ---------------------------------------------------------------- cache integrity
KERNEL = build.Kernel("integrity", '#include "mokgen/sync.cuh"\n'
                      'extern "C" __global__ void k(int* p) { if (p) *p = 2; }\n')


@needs_nvcc
@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "meta"])
def test_corrupted_cached_binary_is_rebuilt(tmp_path, monkeypatch, damage):
    monkeypatch.setattr(build, "CONFIG", build.CONFIG.__class__(
        **{**build.CONFIG.__dict__, "cache": tmp_path}))
    first = build.build([KERNEL])[0]
    good_bytes = first.path.read_bytes()
    assert good_bytes[:4] == b"\x7fELF" and first.image == good_bytes  # what gets loaded
    if damage == "truncate":
        first.path.write_bytes(good_bytes[: len(good_bytes) // 2])
    elif damage == "flip":
        first.path.write_bytes(good_bytes[:100] + bytes([good_bytes[100] ^ 0xFF]) + good_bytes[101:])
    elif damage == "delete":
        first.path.unlink()
    else:
        (first.path.parent / "meta.json").write_text("{not json")
    again = build.build([KERNEL])[0]
    assert not again.cached, "a damaged binary must be rebuilt, not loaded"
    # nvcc embeds the private build folder's path, so compare what matters: an intact ELF
    # whose hash is the one recorded beside it, with the same entry point
    assert again.path.read_bytes()[:4] == b"\x7fELF" and len(again.path.read_bytes()) > 1000
    assert build._load_meta(again.path.parent) is not None and "k" in again.resources
    assert again.image == again.path.read_bytes()
    assert build.build([KERNEL])[0].cached  # and the rebuilt one is trusted again


@needs_nvcc
def test_a_build_waits_for_the_lock_holder_and_builds_what_it_left(tmp_path, monkeypatch):
    """Another process holds the kernel's build lock (here: this test's own flock) and then
    lets go without building, as a killed rank does: the build waits for it, then builds."""
    import fcntl
    import threading

    monkeypatch.setattr(build, "CONFIG", build.CONFIG.__class__(
        **{**build.CONFIG.__dict__, "cache": tmp_path}))
    key = build.cache_key(KERNEL, "sm_90a")
    holder = open(tmp_path / f"lock.{KERNEL.name}.{key}", "a")
    fcntl.flock(holder, fcntl.LOCK_EX)
    out = []
    t = threading.Thread(target=lambda: out.append(build.build([KERNEL])[0]))
    t.start()
    t.join(timeout=3)
    assert t.is_alive() and not out, "the build must wait while the lock is held"
    holder.close()  # the holder goes without a binary
    t.join(timeout=120)
    assert out and not out[0].cached and out[0].image[:4] == b"\x7fELF"
    assert build.build([KERNEL])[0].cached


@needs_nvcc
def test_a_cache_without_file_locks_still_builds(tmp_path, monkeypatch):
    """Some network file systems refuse flock (ENOLCK): each rank then builds, as before
    build locks, and the atomic rename keeps one binary."""
    import errno

    def no_locks(f, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(build, "CONFIG", build.CONFIG.__class__(
        **{**build.CONFIG.__dict__, "cache": tmp_path}))
    monkeypatch.setattr(build.fcntl, "flock", no_locks)
    b = build.build([KERNEL])[0]
    assert not b.cached and b.image[:4] == b"\x7fELF" and build.build([KERNEL])[0].cached


@needs_nvcc
def test_stale_binaries_are_never_reused(monkeypatch):
    base = build.cache_key(KERNEL, "sm_90a")
    monkeypatch.setattr(build, "nvcc_version", lambda: "Cuda compilation tools, release 99.9")
    assert build.cache_key(KERNEL, "sm_90a") != base  # another nvcc
    monkeypatch.undo()
    monkeypatch.setattr(build, "_headers_digest", lambda: "a changed header")
    assert build.cache_key(KERNEL, "sm_90a") != base  # an edited device header
    monkeypatch.undo()
    assert build.cache_key(KERNEL, "sm_90a") == base
