"""mokgen under torchtitan models (small configs built from torchtitan's own, no downloads):
the mokgen_moe override against torchtitan's own MoE on the same weights. CPU through the
reference backend; the same checks on the GPU with the kernels (marked gpu).

torchtitan's grouped GEMMs compute the experts in bf16 (GroupedExperts casts to bf16), and so
does mokgen: the two agree to bf16's tolerance (design: rel. error <= 1e-2), not to fp32's.
Discrete top-k choices are the routers' own and identical given identical inputs, so each
comparison keeps the MoE blocks' inputs identical (the first block of a model is the only MoE
block, or routing is torchtitan's debug round-robin): bf16 rounding differences would
otherwise flip near-tied experts in later blocks."""
import copy

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is an optional extra "
                    "(pip install -e '.[torchtitan]'); it is not installed here")
try:
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import (make_moe_config,
                                                       make_routed_experts_config,
                                                       make_router_config)
    from torchtitan.models.common.moe import MoE
    from torchtitan.models.deepseek_v3 import model_registry as deepseek_registry
    from torchtitan.models.gpt_oss import model_registry as gpt_oss_registry
    from torchtitan.models.kimi_k2_7 import model_registry as kimi_registry
    from torchtitan.models.qwen3 import model_registry as qwen3_registry
except ImportError as e:  # e.g. a torch too old for this torchtitan
    pytest.skip(f"torchtitan does not import here: {e}", allow_module_level=True)

from mokgen.harness.workloads import cosine  # noqa: E402
from mokgen.integrations.torchtitan import (MokgenGroupedExperts, MokgenMoE,  # noqa: E402
                                            MokgenSharedExpert, mokgen_moe, moe_plan)

TARGET = "mokgen.integrations.torchtitan.mokgen_moe"
TOL = 1e-2  # outputs and logits: bf16 experts on both sides
# gradients: mokgen's backward takes the output gradient in bf16 (as its kernels do) where
# torchtitan's combine differentiates in fp32, and the router's gradient (the softmax
# Jacobian: differences of per-expert dot products) amplifies that rounding; two stacked
# blocks reach ~1.1e-2 on the router's gate
GRAD_TOL = 2e-2


def small_moe(dim: int, *, experts=8, top_k=2, hidden=128, score="softmax", groups=None,
              scale=1.0, norm=True, balance=False, shared=None):
    """A MoE block config from torchtitan's own builders (those its model registries use)."""
    init = {"weight": torch.nn.init.normal_}
    cfg = make_moe_config(
        num_experts=experts,
        router=make_router_config(dim=dim, num_experts=experts, gate_param_init=init,
                                  top_k=top_k, score_func=score, route_norm=norm,
                                  route_scale=scale, num_expert_groups=groups,
                                  num_limited_groups=1 if groups else None),
        routed_experts=make_routed_experts_config(
            dim=dim, hidden_dim=hidden, num_experts=experts, top_k=top_k,
            param_init={k: torch.nn.init.normal_ for k in ("w1_EFD", "w2_EDF", "w3_EFD")},
            comm_backend="standard"),
        shared_experts=shared)
    cfg.router._debug_force_load_balance = balance
    return cfg


def qwen3(n_layers=1, balance=False):
    """torchtitan's Qwen3-MoE debug model, cut to n_layers with smaller MoE blocks (8 experts
    of width 128, top-2) so the CPU reference runs in seconds; SDPA attention (flex attention
    has no CPU backward)."""
    cfg = qwen3_registry("debugmodel_moe").model
    cfg.layers = cfg.layers[:n_layers]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.moe = small_moe(cfg.dim, balance=balance)
    return cfg


def deepseek_v3():
    """torchtitan's DeepSeek-V3 debug model cut to its dense layer and one MoE layer (8
    experts of width 256, top-3, a shared expert of width 512)."""
    cfg = deepseek_registry("debugmodel").model
    cfg.layers = cfg.layers[:2]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def kimi_k2_7():
    """torchtitan's Kimi-K2.7 debug model (DeepSeek-V3's blocks: 8 experts of width 256,
    top-3, a shared expert) cut to its dense layer and one MoE layer, text only (its vision
    encoder gets no gradient from text)."""
    cfg = kimi_registry("debugmodel").model
    cfg.layers = cfg.layers[:2]
    cfg.vision_encoder = None
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def convert(cfg, **kwargs):
    """A converted copy of a model config, through torchtitan's override machinery."""
    out = copy.deepcopy(cfg)
    entry = (TARGET, {"backend": "reference", "tokens_per_rank": 2048, **kwargs})
    names = apply_overrides(OverrideConfig(imports=[entry]), out)
    assert names, "the override claimed no MoE block"
    return out


def randomize(model, gen):
    """Fresh normal(0, 1/fan_in) weights (never zeros): every block's output is O(1), so a
    block computed wrong cannot hide under the tolerance; a non-zero load-balancing bias."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=gen) * fan_in ** -0.5
                    if p.dim() > 1 else 1 + 0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias_E"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))


def pair(cfg, **kwargs):
    """(torchtitan's model, the converted model) holding the same weights."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    theirs = cfg.build()
    theirs.init_states()
    randomize(theirs, gen)
    ours = convert(cfg, **kwargs).build()
    missing, unexpected = ours.load_state_dict(theirs.state_dict(), strict=True)
    assert not missing and not unexpected
    return theirs, ours


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def grads_by_torchtitans_names(theirs, ours):
    """(theirs, ours): every parameter's gradient under torchtitan's names (ours fused: split);
    FSDP2's sharded gradients (DTensors) whole."""
    whole = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    want = {n: None if p.grad is None else whole(p.grad) for n, p in theirs.named_parameters()}
    got = {}
    for name, p in ours.named_parameters():
        g = None if p.grad is None else whole(p.grad)
        assert g is not None, name
        if name.endswith("inner_experts.w13") or name.endswith("shared_experts.w13"):
            prefix = name[:-len("w13")]
            first, second = (("w1_EFD", "w3_EFD") if "inner_experts" in name
                             else ("w1.weight", "w3.weight"))
            g1, g3 = g.chunk(2, dim=-2)
            got[prefix + first], got[prefix + second] = g1, g3
        else:
            got[name] = g
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert g is not None and g.norm() > 0, name
    return want, got


def assert_grads_match(theirs, ours, tol=GRAD_TOL):
    want, got = grads_by_torchtitans_names(theirs, ours)
    for name, g in want.items():
        assert rel(got[name], g) <= tol, (name, rel(got[name], g))


def step(model, tokens):
    logits = model(tokens)
    # a loss whose gradient reaches every logit unevenly (not a plain mean)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                             tokens.roll(-1, 1).flatten())
    loss.backward()
    return logits.detach()


# ---------------------------------------------------------------- the blocks
BLOCKS = {
    "qwen3-softmax-norm": lambda: small_moe(256),
    "sigmoid-groups-scaled": lambda: small_moe(256, score="sigmoid", groups=2, scale=2.5,
                                               norm=False),
    "deepseek-v3-shared": lambda: deepseek_v3().layers[1].moe,
    # shared experts the kernels do not compute: torchtitan's modules, run beside
    "qwen3.5-gated-shared": lambda: small_moe(256, shared=gated_shared(256, 512)),
    "biased-shared": lambda: small_moe(256, shared=gated_shared(256, 512, gate=False,
                                                                bias=True)),
}


def gated_shared(dim: int, width: int, gate: bool = True, bias: bool = False):
    """A shared expert mokgen's kernels do not compute: Qwen3.5's sigmoid-gated SwiGLU
    (torchtitan's SigmoidGatedFeedForward, its per-token gate a [1, dim] Linear), or a plain
    FeedForward with biases."""
    from torchtitan.models.common.feed_forward import FeedForward, SigmoidGatedFeedForward
    from torchtitan.models.common.linear import Linear

    lin = lambda i, o: Linear.Config(in_features=i, out_features=o, bias=bias)  # noqa: E731
    parts = dict(w1=lin(dim, width), w2=lin(width, dim), w3=lin(dim, width))
    if gate:
        return SigmoidGatedFeedForward.Config(**parts, gate=Linear.Config(in_features=dim,
                                                                          out_features=1))
    return FeedForward.Config(**parts)


@pytest.mark.parametrize("block", list(BLOCKS))
def test_converted_block_matches_torchtitans_moe(block):
    """One MoE block, same weights and input: output, input gradient and every parameter's
    gradient (the router's gate too: the scores' gradient flows through mokgen)."""
    cfg = BLOCKS[block]()
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    theirs = cfg.build()
    theirs.init_states()
    randomize(theirs, gen)
    ours = mokgen_moe(copy.deepcopy(cfg), backend="reference").build()
    assert isinstance(ours, MokgenMoE)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    fused = block == "deepseek-v3-shared"  # the others' shared experts stay torchtitan's
    assert fused == isinstance(ours.shared_experts, MokgenSharedExpert)
    assert (ours.plan.shape.shared_experts == 1) == fused
    if cfg.shared_experts is not None and not fused:
        assert type(ours.shared_experts) is type(theirs.shared_experts)
    dim = cfg.router.gate.in_features
    x = torch.randn(2, 48, dim, generator=gen)
    outs = []
    for m in (theirs, ours):
        m.train()
        xi = x.clone().requires_grad_()
        y = m(xi)
        (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
        outs.append((y.detach(), xi.grad))
    (y0, dx0), (y1, dx1) = outs
    assert rel(y1, y0) <= TOL and rel(dx1, dx0) <= TOL
    assert_grads_match(theirs, ours)
    # the load-balancing counts torchtitan's optimizer hook reads
    assert torch.equal(ours.tokens_per_expert_E, theirs.tokens_per_expert_E)
    assert ours.tokens_per_expert_E.sum() == x.shape[0] * x.shape[1] * cfg.router.top_k


# the fp8 formats against torchtitan's bf16 MoE (the quantizing reference itself is what the
# reference backend runs): e4m3 with these blocks is 6-8% off bf16 on normal(0, 1/fan_in) data
# (benchmarks/fp8.py's error columns), more with a 128-wide block spanning a whole 128-wide
# expert; gradients as docs/fp8.md holds them (cosine >= 0.996)
FP8_TOL, FP8_COSINE = 0.1, 0.996


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
@pytest.mark.parametrize("block", ["qwen3-softmax-norm", "deepseek-v3-shared"])
def test_fp8_blocks_match_torchtitans_moe_to_fp8s_tolerance(block, fmt):
    """dtype="fp8" / "mxfp8" through the override: the block's output, input gradient and
    every expert and router gradient against torchtitan's bf16 MoE on the same weights."""
    cfg = BLOCKS[block]()
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    theirs = cfg.build()
    theirs.init_states()
    randomize(theirs, gen)
    ours = mokgen_moe(copy.deepcopy(cfg), backend="reference", dtype=fmt).build()
    assert ours.plan.dtype == fmt
    ours.load_state_dict(theirs.state_dict(), strict=True)
    # 384 tokens: the router weight's gradient sums the quantization's error over the tokens,
    # and over 96 its cosine fell to 0.995 (MX) in about one run in twenty
    x = torch.randn(4, 96, cfg.router.gate.in_features, generator=gen)
    outs = []
    for m in (theirs, ours):
        xi = x.clone().requires_grad_()
        y = m(xi)
        (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
        outs.append((y.detach(), xi.grad))
    (y0, dx0), (y1, dx1) = outs
    # above bf16's agreement (TOL): the quantization ran; within the formats' error
    assert TOL < rel(y1, y0) <= FP8_TOL, rel(y1, y0)
    assert cosine(dx1, dx0) >= FP8_COSINE
    want, got = grads_by_torchtitans_names(theirs, ours)
    for name, g in want.items():
        assert cosine(got[name], g) >= FP8_COSINE, (name, cosine(got[name], g))


# ---------------------------------------------------------------- the models
MODELS = {
    "qwen3-moe": lambda: qwen3(n_layers=1),
    "qwen3-moe-2-layers-balanced": lambda: qwen3(n_layers=2, balance=True),
    "deepseek-v3": deepseek_v3,
    "kimi-k2.7": kimi_k2_7,
}


@pytest.mark.parametrize("family", list(MODELS))
def test_converted_model_matches_logits_and_all_gradients(family):
    theirs, ours = pair(MODELS[family]())
    converted = [m for m in ours.modules() if isinstance(m, MokgenMoE)]
    assert converted and len(converted) == sum(isinstance(m, MoE) for m in theirs.modules())
    tokens = torch.randint(0, theirs.config.vocab_size, (2, 40))
    a, b = step(theirs, tokens), step(ours, tokens)
    assert rel(b, a) <= TOL
    assert_grads_match(theirs, ours)


@pytest.mark.parametrize("ac,compiled", [("selective", True), ("full", False)])
def test_torchtitans_parallelize_fsdp2_checkpointing_compile(ac, compiled, tmp_path,
                                                             monkeypatch):
    """torchtitan's own parallelize_qwen3 (spmd_types sharding, its activation checkpointing,
    torch.compile of each block with fullgraph=True (aot_eager on CPU), FSDP2 with bf16
    parameters) over both models, one gloo rank on CPU: a training step's logits and
    gradients agree, and the converted model keeps torchtitan's state-dict keys."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.qwen3 import parallelize_qwen3
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    monkeypatch.setattr(parallel_dims, "device_type", "cpu")  # its meshes, on a CPU machine
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        parallelism = ParallelismConfig()
        dist_utils.set_spmd_backend(parallelism.spmd_backend)
        cfg = qwen3(n_layers=2, balance=True)
        set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=False)  # as the trainer does
        ac_config = SelectiveAC.Config() if ac == "selective" else FullAC.Config()
        models, state = [], None
        for c in (cfg, convert(cfg)):
            with torch.device("meta"):
                model = c.build()
            model.to_empty(device="cpu")
            model.init_states()
            if state is None:
                randomize(model, torch.Generator().manual_seed(torch.seed() % 2**31))
                state = model.state_dict()
            else:
                model.load_state_dict(state, strict=True)
            models.append(parallelize_qwen3(
                model, parallel_dims=ParallelDims.from_config(parallelism, 1),
                training=TrainingConfig(), parallelism=parallelism,
                compile_config=CompileConfig(enable=compiled, backend="aot_eager"),
                ac_config=ac_config,
                dump_folder=str(tmp_path)))
        theirs, ours = models
        assert any(isinstance(m, MokgenMoE) for m in ours.modules())
        tokens = torch.randint(0, cfg.vocab_size, (2, 40))
        a, b = step(theirs, tokens), step(ours, tokens)
        assert rel(b, a) <= TOL
        assert_grads_match(theirs, ours, tol=2 * GRAD_TOL)  # FSDP's bf16 parameters
        # torchtitan's checkpointer saves model.state_dict() (DCP writes it) and loads
        # with load_state_dict(strict=False): under FSDP2, torchtitan's keys both ways
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        whole = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
        with torch.no_grad():
            negated = {k: -v.detach() for k, v in theirs.state_dict().items()}
            for model in (ours, theirs):  # weights neither model held
                missing, unexpected = model.load_state_dict(negated, strict=False)
                assert not missing and not unexpected
            assert rel(ours(tokens), theirs(tokens)) <= TOL
            back = ours.state_dict()
            for key, value in negated.items():
                assert torch.equal(whole(back[key]), whole(value)), key
    finally:
        dist.destroy_process_group()


def test_blocks_compiled_one_by_one_share_one_graph():
    """torchtitan compiles each block on its own (fullgraph=True), one code object for all:
    the converted blocks trace to one graph, no recompile per block, and still compute what
    the uncompiled model does."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = qwen3(n_layers=3, balance=True)
    eager = convert(cfg).build()
    eager.init_states()
    randomize(eager, torch.Generator().manual_seed(torch.seed() % 2**31))
    compiled = copy.deepcopy(eager)
    for block in compiled.layers.values():
        block.compile(backend="aot_eager", fullgraph=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40))
    a, b = step(eager, tokens), step(compiled, tokens)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    assert rel(b, a) <= 1e-5
    want = dict(eager.named_parameters())
    for name, p in compiled.named_parameters():
        assert rel(p.grad, want[name].grad) <= 1e-4, name


def test_blocks_sharing_a_registration_keep_a_weight_set_each():
    """The shared registration counts its blocks, so the compiled layer's fp8 weight cache
    holds every block's quantized weights from forward to backward (none re-quantizes)."""
    model = convert(qwen3(n_layers=3), backend="kernels", dtype="mxfp8").build()
    (registration,) = {id(b.moe._registration): b.moe._registration
                       for b in model.layers.values()}.values()
    assert registration.kernels.weight_sets == 3
    (copied,) = {id(b.moe._registration): b.moe._registration
                 for b in copy.deepcopy(model).layers.values()}.values()
    assert copied is not registration and copied.kernels.weight_sets == 3


def test_the_experts_are_what_sets_the_logits():
    """The tolerance means something: the same model with one expert's gate and up weights
    exchanged is far outside it."""
    theirs, ours = pair(qwen3(n_layers=1))
    tokens = torch.randint(0, theirs.config.vocab_size, (2, 40))
    with torch.no_grad():
        a = theirs(tokens)
        inner = ours.layers["0"].moe.routed_experts.inner_experts
        inner.w13.copy_(inner.w13.roll(inner.hidden_dim, dims=-2))
        assert rel(ours(tokens), a) > 20 * TOL


def test_checkpoints_load_both_ways_and_keep_torchtitans_keys(tmp_path):
    """A state dict saved by either model loads in the other (strict) and gives the same
    outputs; the keys are torchtitan's (w1_EFD, w3_EFD, shared w1/w3 Linears)."""
    theirs, ours = pair(deepseek_v3())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    tokens = torch.randint(0, theirs.config.vocab_size, (2, 24))
    torch.save(ours.state_dict(), tmp_path / "ours.pt")
    torch.save(theirs.state_dict(), tmp_path / "theirs.pt")
    sd_ours = torch.load(tmp_path / "ours.pt")
    for key, value in theirs.state_dict().items():  # saved halves equal theirs exactly
        assert torch.equal(sd_ours[key], value), key
    cfg = deepseek_v3()
    gen = torch.Generator().manual_seed(3)
    fresh_theirs, fresh_ours = cfg.build(), convert(cfg).build()
    randomize(fresh_theirs, gen)
    randomize(fresh_ours, gen)
    fresh_theirs.load_state_dict(sd_ours, strict=True)
    fresh_ours.load_state_dict(torch.load(tmp_path / "theirs.pt"), strict=True)
    with torch.no_grad():
        assert torch.equal(fresh_theirs(tokens), theirs(tokens))  # ours' checkpoint, bitwise
        assert torch.equal(fresh_ours(tokens), ours(tokens))
    inner = fresh_ours.layers["1"].moe.routed_experts.inner_experts
    assert isinstance(inner, MokgenGroupedExperts)
    w = theirs.layers["1"].moe.routed_experts.inner_experts
    assert torch.equal(inner.w13, torch.cat([w.w1_EFD, w.w3_EFD], dim=1))  # stored fused


def test_init_states_initializes_gate_and_up_with_their_own_initializers():
    """torchtitan's param_init for w1_EFD / w3_EFD reaches the fused weight's halves: a
    constant initializer per half shows which half each went to."""
    cfg = small_moe(256)
    const = lambda v: lambda t: torch.nn.init.constant_(t, v)  # noqa: E731
    cfg.routed_experts.inner_experts.param_init = {"w1_EFD": const(1.0), "w3_EFD": const(3.0),
                                                   "w2_EDF": const(2.0)}
    ours = mokgen_moe(cfg, backend="reference").build()
    ours.init_states()
    inner = ours.routed_experts.inner_experts
    assert (inner.w1_EFD == 1).all() and (inner.w3_EFD == 3).all() and (inner.w2_EDF == 2).all()


def test_unsupported_configurations_are_refused_at_conversion():
    with pytest.raises(ValueError, match="gpt-oss"):
        gpt = gpt_oss_registry("debugmodel").model
        apply_overrides(OverrideConfig(imports=[TARGET]), gpt)
    with pytest.raises(ValueError, match="backend"):
        mokgen_moe(small_moe(256), backend="triton")
    with pytest.raises(ValueError, match="dtype"):
        mokgen_moe(small_moe(256), dtype="fp4")
    with pytest.raises(ValueError):  # a width mokgen's kernels cannot address
        mokgen_moe(small_moe(256, hidden=100))
    # a MokgenMoE config built by hand around a plain SwiGLU shared expert, which the plan
    # fuses but the module would not hold in mokgen's layout
    converted = mokgen_moe(small_moe(256), backend="reference")
    converted.shared_experts = deepseek_v3().layers[1].moe.shared_experts
    with pytest.raises(ValueError, match="MokgenSharedExpert"):
        converted.build()


def test_expert_and_tensor_parallelism_are_refused():
    """EP > 1 shows in the config torchtitan prepares (update_from_config writes the experts'
    'ep' sharding); TP on the experts when the model is parallelized."""
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    import spmd_types as spmd

    cfg = small_moe(256)
    set_moe_sharding_config(cfg, enable_ep=True, enable_sp=False,
                            expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2),
                                                 "w3_EFD": spmd.S(1)})
    with pytest.raises(ValueError, match="expert parallelism"):
        mokgen_moe(cfg)
    ours = mokgen_moe(small_moe(256), backend="reference").build()

    class Dims:  # the two fields MokgenMoE.parallelize reads of torchtitan's ParallelDims
        ep, tp = 1, 2
    with pytest.raises(ValueError, match="tensor parallelism"):
        ours.parallelize(Dims())
    Dims.ep, Dims.tp = 2, 1
    with pytest.raises(ValueError, match="expert parallelism"):
        ours.parallelize(Dims())


def test_too_many_tokens_name_the_option():
    ours = mokgen_moe(small_moe(256), backend="reference", tokens_per_rank=64).build()
    ours.init_states()
    with pytest.raises(ValueError, match="tokens_per_rank"):
        ours(torch.randn(2, 40, 256))


@pytest.mark.parametrize("block", list(BLOCKS))
def test_moe_plan_is_the_plan_a_converted_block_runs(block):
    """moe_plan of torchtitan's own config (what benchmarks compile ahead) and the plan the
    converted block built: one plan, so kernels built ahead are the ones a run loads."""
    cfg = BLOCKS[block]()
    built = mokgen_moe(cfg, backend="reference", tokens_per_rank=512, dtype="fp8").build()
    assert moe_plan(cfg, tokens_per_rank=512, dtype="fp8").to_json() == built.plan.to_json()


def test_the_override_is_found_by_name_and_idempotent():
    cfg = qwen3(n_layers=2)
    out = convert(cfg)
    assert all(isinstance(layer.moe, MokgenMoE.Config) for layer in out.layers)
    assert mokgen_moe(out.layers[0].moe) is out.layers[0].moe


# ---------------------------------------------------------------- GPU: the kernels
gpu = pytest.mark.gpu


def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (sm_90a)")


@gpu
@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3", "kimi-k2.7"])
def test_gpu_kernels_match_torchtitans_moe(family):
    """As the CPU model test, on CUDA in bf16 through mokgen's kernels."""
    _cuda_or_skip()
    cfg = MODELS[family]()
    torch.manual_seed(torch.seed() % 2**31)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    theirs = cfg.build()
    theirs.init_states()
    randomize(theirs, gen)
    theirs = theirs.cuda().to(torch.bfloat16)
    ours = convert(cfg, backend="kernels").build().cuda().to(torch.bfloat16)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    tokens = torch.randint(0, theirs.config.vocab_size, (4, 256), device="cuda")
    a, b = step(theirs, tokens), step(ours, tokens)
    assert rel(b, a) <= TOL
    assert_grads_match(theirs, ours, tol=2 * GRAD_TOL)  # a bf16 model: rounding everywhere


@gpu
def test_gpu_checkpoint_round_trip():
    _cuda_or_skip()
    cfg = deepseek_v3()
    theirs = cfg.build()
    theirs.init_states()
    randomize(theirs, torch.Generator().manual_seed(5))
    theirs = theirs.cuda().to(torch.bfloat16)
    ours = convert(cfg, backend="kernels").build().cuda().to(torch.bfloat16)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    back = cfg.build().cuda().to(torch.bfloat16)
    back.load_state_dict(ours.state_dict(), strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), device="cuda")
    with torch.no_grad():
        assert torch.equal(back(tokens), theirs(tokens))
        assert rel(ours(tokens), theirs(tokens)) <= TOL


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_gpu_steps_under_torchtitans_cuda_graph_wrapper_track_eager(dtype):
    """torchtitan's trainer captures each step's forward and backward (wrap_with_cuda_graph:
    the first call eager, the second captured, then replays) and steps the optimizer eagerly
    between them: a converted model's losses under it track an eager twin's from the same
    weights (fp8: the graph quantizes the stepped weights on every replay). SGD, not AdamW,
    so a rounding difference is not amplified to a whole step; not bitwise, since the rest
    of the model may run other cuBLAS kernels on the capture stream."""
    _cuda_or_skip()
    from torchtitan.distributed.cudagraph import wrap_with_cuda_graph

    cfg = MODELS["qwen3-moe"]()
    base = cfg.build()
    base.init_states()
    randomize(base, torch.Generator().manual_seed(torch.seed() % 2**31))
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), device="cuda")
    losses = []
    for wrap in (lambda f: f, wrap_with_cuda_graph):
        model = convert(cfg, backend="kernels", dtype=dtype).build()
        model.load_state_dict(base.state_dict(), strict=True)
        model = model.cuda().to(torch.bfloat16)

        def fwd_bwd(inputs, labels, global_valid_tokens, extra_kwargs, model=model):
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                     labels.flatten())
            loss.backward()
            return loss

        fwd_bwd, opt, run = wrap(fwd_bwd), torch.optim.SGD(model.parameters(), lr=0.1), []
        for _ in range(5):
            opt.zero_grad(set_to_none=False)  # a captured step adds into the same .grad
            loss = fwd_bwd(tokens, tokens.roll(-1, 1), torch.ones((), device="cuda"), {})
            run.append(loss.item())  # a replay's loss is the graph's: read it now
            opt.step()
        losses.append(run)
    eager, graphed = losses
    assert eager[-1] < 0.8 * eager[0], eager  # the steps change what the model computes
    for a, b in zip(eager, graphed):
        assert abs(a - b) <= 2e-2 * a, (eager, graphed)
