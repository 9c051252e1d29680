"""Shapes beyond the four main presets: random shapes either plan or are refused with a
ValueError naming a kernel rule; a sample of the planned ones, every public model's preset
the planner accepts and the routing extremes compile with nvcc, forward and backward, without
spills (nvcc-marked tests)."""
import functools
import random
import re
import shutil

import pytest

import mokgen
from mokgen.compiler import codegen, limits
from mokgen.shapes import PRESETS_MODELS
from conftest import assert_spills_within_known
from test_limits import REFUSED, ep_over_one

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
SEED = 16  # fixed: CI compiles the same sample every run
FIELDS = ("num_experts", "topk", "ep", "hidden", "intermediate", "shared_intermediate",
          "tokens_per_rank")


def width(r: random.Random, tile: int) -> int:
    """Mostly whole tiles, sometimes any multiple of 8 (what MoEShape itself accepts)."""
    return tile * r.randint(1, 8192 // tile) if r.random() < 0.75 else 8 * r.randint(1, 1024)


def draw(r: random.Random) -> dict:
    e = r.randint(1, 64) if r.random() < 0.5 else r.randint(1, 1100)
    shared = r.random() < 0.5
    shape = mokgen.MoEShape(e, width(r, 256), width(r, 128), r.randint(1, min(e, 36)),
                            shared_experts=int(shared),
                            shared_intermediate=width(r, 128) if shared else None)
    ep = r.choice([d for d in range(1, min(e, 600) + 1) if e % d == 0])
    return dict(shape=shape, ep=ep, dtype=r.choice(("bf16", "fp8", "mxfp8")),
                tokens_per_rank=r.choice([64, 300, 2048, 8192]))


@functools.cache
def outcomes(n: int = 400) -> list:
    """(problem, plan or the ValueError's text) for n random draws."""
    r, out = random.Random(SEED), []
    for _ in range(n):
        problem = draw(r)
        try:
            out.append((problem, mokgen.plan(**problem)))
        except ValueError as err:
            out.append((problem, str(err)))
    return out


def test_random_shapes_plan_or_are_refused_naming_the_rule():
    results = outcomes()
    planned = [p for _, p in results if not isinstance(p, str)]
    refused = [m for _, m in results if isinstance(m, str)]
    assert len(planned) >= 100 and len(refused) >= 50, (len(planned), len(refused))
    for message in refused:
        for sentence in message.split("; "):
            assert re.match(rf"({'|'.join(FIELDS)}|ep \* tokens_per_rank \* topk) must be",
                            sentence), sentence
    for p in planned:  # what the planner accepts, codegen emits (forward, maybe backward)
        units = {k.name.split("_")[0] for k in codegen.emit(p)}
        assert units == expected_units(p)
    kinds = {(p.shape.num_experts % 32 != 0, p.dtype, not limits.backward_unsupported(p))
             for p in planned}
    assert {(True, d, True) for d in ("bf16", "fp8", "mxfp8")} <= kinds


def expected_units(p) -> set:
    """The forward; the backward unless refused; beside it keep_h plans' resident twin (the
    default at ep 1 in bf16 where the ring holds every minibatch)."""
    if limits.backward_unsupported(p):
        return {"prologue", "fwd"}
    return {"prologue", "fwd", "bwd"} | ({"bwdres"} if p.keep_h else set())


def sample() -> list:
    """The planned shapes nvcc builds: the first with 32 not dividing E of each dtype, with a
    backward, plus the first with k > 8 and fewer local experts than k."""
    picked, planned = [], [p for _, p in outcomes() if not isinstance(p, str)]
    for dtype in ("bf16", "fp8", "mxfp8"):
        picked.append(next(p for p in planned if p.dtype == dtype
                           and p.shape.num_experts % 32 and not limits.backward_unsupported(p)))
    picked.append(next(p for p in planned if p.dtype == "bf16" and p.shape.topk > 8
                       and p.local_experts < p.shape.topk and p not in picked))
    return picked


def assert_builds_clean(layer, units):
    assert set(layer.binaries) == set(units), layer.binaries.keys()
    for unit, b in layer.binaries.items():
        assert b.path.exists()
        for fn, r in b.resources.items():
            assert_spills_within_known(layer, unit, fn, r)


@pytest.mark.nvcc
@needs_nvcc
@pytest.mark.parametrize("i", range(4))
def test_sampled_random_shapes_compile_without_spills(i):
    p = sample()[i]
    layer = mokgen.compile(p.shape, ep=p.ep, dtype=p.dtype, tokens_per_rank=p.tokens_per_rank)
    assert layer.plan == p
    assert_builds_clean(layer, expected_units(p))


@pytest.mark.nvcc
@needs_nvcc
@pytest.mark.parametrize("name", [n for n in PRESETS_MODELS if n not in REFUSED])
def test_model_presets_compile_without_spills(name):
    """Every public model's preset the planner accepts: models of 16 experts or fewer at ep 1
    (one GPU holds them), the others at their largest ep <= 64; about 10 s each here."""
    s = mokgen.shapes.get(name)
    ep = 1 if s.num_experts <= 16 else ep_over_one(s.num_experts)
    layer = mokgen.compile(s, ep=ep, tokens_per_rank=2048)
    assert_builds_clean(layer, expected_units(layer.plan))


@pytest.mark.nvcc
@needs_nvcc
def test_routing_extremes_compile_without_spills():
    """The prologue (routing, schedule) at the ends of the expert and top-k ranges: one expert,
    33 (one lane-column past 32), 1024 with k = 32 (32 logits per lane)."""
    from mokgen.compiler import build

    plans = [mokgen.plan(mokgen.MoEShape(e, 256, 128, k), ep=ep, tokens_per_rank=256)
             for e, k, ep in ((1, 1, 1), (33, 32, 3), (1024, 32, 8))]
    kernels = [k for p in plans for k in codegen.emit(p, units=("prologue",))]
    for b in build.build(kernels):
        for fn, r in b.resources.items():
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, \
                (b.name, fn, r)
