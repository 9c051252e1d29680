"""mokgen under transformers models (random tiny configs, no downloads), on CPU through the
reference path: converted weights reproduce each family's own MoE block and model."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import mokgen  # noqa: E402
from mokgen.integrations.transformers import PatchedMoEBlock, patch  # noqa: E402

# Widths within the kernels' rules (mokgen.compiler.limits): mokgen.compiler.plan refuses others, whatever the backend.
COMMON = dict(vocab_size=128, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)


def qwen3(norm=True):
    return transformers.Qwen3MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=128,
                                       num_experts=8, num_experts_per_tok=2, head_dim=16,
                                       norm_topk_prob=norm)


def mixtral():
    return transformers.MixtralConfig(**COMMON, intermediate_size=128, num_local_experts=8,
                                      num_experts_per_tok=2, head_dim=16)


def deepseek():
    return transformers.DeepseekV3Config(
        **COMMON, intermediate_size=128, moe_intermediate_size=128, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)


def olmoe():
    return transformers.OlmoeConfig(**COMMON, intermediate_size=128, num_experts=8,
                                    num_experts_per_tok=2)


def qwen2_moe():  # a shared expert scaled by a sigmoid gate: runs beside mokgen's call
    return transformers.Qwen2MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=128,
                                       shared_expert_intermediate_size=256, num_experts=8,
                                       num_experts_per_tok=2)


def qwen3_next():  # (2 layers are linear attention only: no cache to build)
    return transformers.Qwen3NextConfig(**COMMON, intermediate_size=128, moe_intermediate_size=128,
                                        shared_expert_intermediate_size=128, num_experts=8,
                                        num_experts_per_tok=2, head_dim=16, use_cache=False)


def qwen3_5():
    return transformers.Qwen3_5MoeTextConfig(**COMMON, moe_intermediate_size=128,
                                             shared_expert_intermediate_size=128, num_experts=8,
                                             num_experts_per_tok=2, head_dim=16, use_cache=False)


def deepseek_v2():
    return transformers.DeepseekV2Config(
        **COMMON, intermediate_size=128, moe_intermediate_size=128, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)


def glm4_moe():
    return transformers.Glm4MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=128,
                                      n_routed_experts=8, n_shared_experts=1,
                                      num_experts_per_tok=2, first_k_dense_replace=1,
                                      head_dim=16)


def ernie4_5():
    return transformers.Ernie4_5_MoeConfig(**COMMON, intermediate_size=128,
                                           moe_intermediate_size=128, moe_num_experts=8, moe_k=2,
                                           moe_num_shared_experts=1)


def minimax():
    return transformers.MiniMaxConfig(**COMMON, intermediate_size=128, num_local_experts=8,
                                      num_experts_per_tok=2, head_dim=16)


def phimoe():  # without its training-time router jitter, so both runs route alike
    return transformers.PhimoeConfig(**COMMON, intermediate_size=128, num_local_experts=8,
                                     num_experts_per_tok=2, router_jitter_noise=0.0)


def granitemoe():
    return transformers.GraniteMoeConfig(**COMMON, intermediate_size=128, num_local_experts=8,
                                         num_experts_per_tok=2)


FAMILIES = {"qwen3": qwen3, "qwen3-unnormed": lambda: qwen3(False), "mixtral": mixtral,
            "deepseek-v3": deepseek, "olmoe": olmoe, "qwen2-moe": qwen2_moe,
            "qwen3-next": qwen3_next, "qwen3.5": qwen3_5, "deepseek-v2": deepseek_v2,
            "glm-4.5": glm4_moe, "ernie-4.5": ernie4_5, "minimax": minimax, "phi-3.5-moe": phimoe,
            "granite-moe": granitemoe}


def test_every_family_of_the_patch_has_a_case():
    from mokgen.integrations.transformers import FAMILIES as PATCHED

    found = set()
    for make in FAMILIES.values():
        found |= {type(m).__name__ for m in build(make).modules()} & set(PATCHED)
    assert found == set(PATCHED)


def build(make):
    try:
        config = make()
    except AttributeError as e:  # a family this transformers release does not have
        pytest.skip(f"transformers {transformers.__version__}: {e}")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for m in model.modules():  # non-trivial selection bias where the family has one
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.copy_(torch.randn_like(m.e_score_correction_bias) * 0.1)
    return model


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_blocks_and_model_match_the_originals(family):
    model = build(FAMILIES[family])
    patched = copy.deepcopy(model)
    names = patch(patched, backend="reference")
    assert names and all(isinstance(patched.get_submodule(n), PatchedMoEBlock) for n in names)
    assert patched.state_dict().keys() == model.state_dict().keys()  # checkpoints still load
    x = torch.randn(2, 9, COMMON["hidden_size"])
    for name in names:
        assert rel(patched.get_submodule(name)(x), model.get_submodule(name)(x)) <= 1e-5
    ids = torch.randint(0, 128, (2, 12))
    assert rel(patched(ids).logits, model(ids).logits) <= 1e-5


@pytest.mark.parametrize("family", ["qwen3", "deepseek-v3", "olmoe", "qwen2-moe", "glm-4.5",
                                    "phi-3.5-moe"])
def test_patched_gradients_match(family):
    model = build(FAMILIES[family]).train()
    patched = copy.deepcopy(model)
    patch(patched, backend="reference")
    ids = torch.randint(0, 128, (2, 12))
    for m in (model, patched):
        m(ids, labels=ids).loss.backward()
    grads = dict(model.named_parameters())
    for name, p in patched.named_parameters():
        want = grads[name].grad
        if want is None or want.norm() == 0:
            assert p.grad is None or p.grad.norm() == 0, name
            continue
        assert rel(p.grad, want) <= 1e-4, name


@pytest.mark.parametrize("family,fused", [("deepseek-v2", True), ("glm-4.5", True),
                                          ("ernie-4.5", True), ("qwen2-moe", False),
                                          ("olmoe", False)])
def test_a_plain_shared_expert_runs_in_mokgens_call_a_gated_one_beside_it(family, fused):
    model = build(FAMILIES[family])
    patch(model, backend="reference")
    block = next(m for m in model.modules() if isinstance(m, PatchedMoEBlock))
    assert bool(block.plan.shape.shared_experts) == fused


def test_experts_are_used_in_place_not_copied():
    model = build(qwen3)
    block = model.model.layers[0].mlp
    ptr = block.experts.gate_up_proj.data_ptr()
    patch(model, backend="reference")
    assert model.model.layers[0].mlp.experts.gate_up_proj.data_ptr() == ptr


def test_unsupported_models_get_a_clear_error():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no supported MoE block"):
        patch(model)
    with pytest.raises(ValueError, match="not a supported MoE block"):
        PatchedMoEBlock(torch.nn.Linear(4, 4))
    block = build(olmoe).model.layers[0].mlp
    block.experts.register_parameter("down_proj_bias", torch.nn.Parameter(torch.zeros(8, 256)))
    with pytest.raises(ValueError, match="no biases.*down_proj_bias"):
        PatchedMoEBlock(block)
    del block.experts.gate_up_proj
    with pytest.raises(ValueError, match="3D gate_up_proj"):
        PatchedMoEBlock(block)
    assert mokgen.patch is patch


def test_fused_accumulation_targets_are_this_ranks_slices_of_the_experts_grads():
    """PatchedMoEBlock.expert_grads: the slices of gate_up_proj.grad / down_proj.grad that
    belong to the rank's experts, only for the weights the block's forward passes (views of
    those parameters) and only once the gradients exist."""
    model = build(qwen3)
    patch(model, backend="reference", fuse_grad_accumulation=True)
    block = next(m for m in model.modules() if isinstance(m, PatchedMoEBlock))
    p1, p2 = block.experts.gate_up_proj, block.experts.down_proj
    block.rank, block.local = 1, p1.shape[0] // 2  # as rank 1 of an ep = 2 group
    w1, w2 = block._local(p1), block._local(p2)
    assert block.expert_grads(w1, w2) is None  # no .grad yet
    p1.grad, p2.grad = torch.zeros_like(p1), torch.zeros_like(p2)
    g1, g2 = block.expert_grads(w1, w2)
    assert g1.shape == w1.shape and g2.shape == w2.shape and g1.is_contiguous()
    assert g1.data_ptr() == p1.grad[block.local:].data_ptr()  # rank 1's half, in place
    assert g2.data_ptr() == p2.grad[block.local:].data_ptr()
    assert block.expert_grads(p1[:block.local], w2) is None  # other experts' weights
    assert block.expert_grads(w1.clone(), w2) is None       # a copy, not the parameter
