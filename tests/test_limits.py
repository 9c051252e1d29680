"""The kernels' rules at plan time (mokgen.compiler.limits) and the public models' presets (CPU)."""
import re

import pytest

import mokgen
from mokgen.compiler import codegen, limits
from mokgen.shapes import PRESETS_MODELS, get

# Presets the kernels refuse today (bf16), with the field that says why: none since edge
# tiles (fp8 and MXFP8 too since partial scale blocks: test_fp8_needs_16_wide_k below).
REFUSED: dict = {}


def backward_row(plan, text: str):
    """The plan table's backward row, if it starts with `text`."""
    return re.search(rf"^backward +{re.escape(text)}", str(plan), re.M)


def ep_over_one(e: int) -> int:
    """The largest ep <= 64 (an EP-64 deployment at most) dividing E, above 1."""
    return max(d for d in range(2, min(e, 64) + 1) if e % d == 0)


@pytest.mark.parametrize("name", PRESETS_MODELS)
def test_every_model_preset_plans_at_ep1_and_ep_over_one(name):
    s = get(name)
    for ep in (1, ep_over_one(s.num_experts)):
        if name in REFUSED:
            with pytest.raises(ValueError, match=f"{REFUSED[name]} must be a multiple of"):
                mokgen.plan(s, ep=ep)
            continue
        p = mokgen.plan(s, ep=ep, tokens_per_rank=4096)
        assert p.local_experts * ep == s.num_experts
        assert bool(backward_row(p, "yes")) == (limits.backward_unsupported(p) is None)


def test_model_presets_numbers():
    assert len(PRESETS_MODELS) >= 12
    assert set(PRESETS_MODELS).isdisjoint(mokgen.shapes.PRESETS_MAIN)
    want = {  # E, D, I, k, shared intermediate (config.json; see mokgen/shapes.py)
        "qwen3-30b-a3b": (128, 2048, 768, 8, 0), "qwen3-235b-a22b": (128, 4096, 1536, 8, 0),
        "qwen1.5-moe-a2.7b": (60, 2048, 1408, 4, 5632),
        "deepseek-v2-lite": (64, 2048, 1408, 6, 2816), "deepseek-v3": (256, 7168, 2048, 8, 2048),
        "mixtral-8x7b": (8, 4096, 14336, 2, 0), "mixtral-8x22b": (8, 6144, 16384, 2, 0),
        "olmoe-1b-7b": (64, 2048, 1024, 8, 0), "gpt-oss-20b": (32, 2880, 2880, 4, 0),
        "llama-4-scout": (16, 5120, 8192, 1, 8192), "granite-3.0-3b-a800m": (40, 1536, 512, 8, 0),
    }
    for name, numbers in want.items():
        s = get(name)
        assert (s.num_experts, s.hidden, s.intermediate, s.topk, s.shared_dim) == numbers, name
        assert s.name == name


@pytest.mark.parametrize("e,k,ep", [(60, 1, 1), (60, 4, 4), (60, 8, 6), (40, 8, 8), (40, 32, 2),
                                    (1, 1, 1), (7, 7, 7), (1000, 32, 8), (1024, 10, 512)])
def test_any_expert_count_and_topk_up_to_32_plan(e, k, ep):
    p = mokgen.plan(mokgen.MoEShape(e, 512, 256, k), ep=ep, tokens_per_rank=256)
    assert p.local_experts == e // ep and limits.backward_unsupported(p) is None


@pytest.mark.parametrize("shape,kw,match", [
    (mokgen.MoEShape(1025, 512, 256, 8), {}, "num_experts must be <= 1024"),
    (mokgen.MoEShape(64, 512, 256, 33), {}, "topk must be <= 32"),
    (mokgen.MoEShape(1024, 512, 256, 8), dict(ep=1024), "ep must be <= 512"),
    (mokgen.MoEShape(64, 512, 256, 32), dict(ep=64, tokens_per_rank=2**20), "32-bit"),
    (mokgen.MoEShape(64, 328, 256, 8), dict(dtype="fp8"), "hidden must be a multiple of 16"),
    (mokgen.MoEShape(64, 512, 200, 8), dict(dtype="mxfp8"),
     "intermediate must be a multiple of 16"),
    (mokgen.MoEShape(64, 512, 256, 8), dict(dispatch="push"), "dispatch must be one of"),
    (mokgen.MoEShape(64, 512, 256, 8), dict(combine="pull"), "combine must be one of"),
    (mokgen.MoEShape(64, 512, 256, 8), dict(reverse_dispatch="pull"),
     "reverse_dispatch must be one of"),
    (mokgen.MoEShape(64, 512, 256, 8), dict(reverse_combine="sideways"),
     "reverse_combine must be one of"),
    (mokgen.MoEShape(64, 512, 256, 8), dict(ep=8, reverse_dispatch="ring"),
     "reverse_dispatch='ring' needs ep == 1, dtype bf16"),
    (mokgen.MoEShape(64, 512, 256, 8), dict(dtype="fp8", reverse_dispatch="ring"),
     "reverse_dispatch='ring' needs ep == 1, dtype bf16"),
    (mokgen.MoEShape(64, 512, 256, 8), dict(dispatch="gather", reverse_combine="gather",
                                            reverse_dispatch="ring", minibatch=256,
                                            macrobatch=2048),
     "reverse_dispatch='ring' needs .* reverse_combine 'pull'"),
    (mokgen.MoEShape(64, 512, 256, 8), dict(reverse_dispatch="ring", minibatch=128,
                                            macrobatch=256),
     "reverse_dispatch='ring' needs a ring that holds every minibatch"),
    (mokgen.MoEShape(64, 512, 256, 8), dict(dispatch="gather", reverse_combine="gather",
                                            reverse_dispatch="ring"),
     "reverse_combine='gather' needs reverse_dispatch='push'"),
])
def test_every_kernel_rule_is_a_plan_time_error_naming_the_field(shape, kw, match):
    with pytest.raises(ValueError, match=match):
        mokgen.plan(shape, **(dict(ep=1, tokens_per_rank=256) | kw))


def test_backward_support_is_in_the_plan_table_and_decides_the_units():
    """Every width the forward takes has a backward now (odd multiples of 128 end in edge
    tiles): Qwen1.5-MoE's intermediate 1408 gets one, and the table says so."""
    for p in (mokgen.plan(get("granite-3.0-3b-a800m"), ep=8),
              mokgen.plan(get("qwen1.5-moe-a2.7b"), ep=4)):
        assert backward_row(p, "yes") and limits.backward_unsupported(p) is None
        assert sorted(k.name.split("_")[0] for k in codegen.emit(p)) == ["bwd", "fwd", "prologue"]


def test_fp8_needs_16_wide_k():
    """fp8 and MXFP8 take any width of whole 16-byte e4m3 vectors: gpt-oss-20b's 2880 (22.5
    blocks of 128) and a partial MX block of 16 plan, forward and backward; 8 more does not,
    and the error names the field and the rule."""
    for dtype in ("fp8", "mxfp8"):
        for s in (get("gpt-oss-20b"), mokgen.MoEShape(8, 2048 + 16, 768 + 16, 2)):
            p = mokgen.plan(s, ep=4 if s.num_experts == 32 else 2, dtype=dtype)
            assert limits.backward_unsupported(p) is None and backward_row(p, "yes")
        for field, shape in (("hidden", mokgen.MoEShape(8, 2880 + 8, 2880, 4)),
                             ("intermediate", mokgen.MoEShape(8, 2880, 2880 + 8, 4))):
            with pytest.raises(ValueError, match=f"{field} must be a multiple of 16 .*{dtype}"):
                mokgen.plan(shape, ep=2, dtype=dtype)
