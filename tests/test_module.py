"""mokgen.MoE and the custom op on CPU: reference equality, state dicts, autograd,
torch.compile(fullgraph=True), argument checks."""
import copy

import pytest
import torch

import mokgen
from mokgen.pytorch import ops
from mokgen.reference import ReferenceMoE

SHAPE = mokgen.shapes.get("small")  # E=16 D=256 I=256 k=4, shared expert


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def pair():
    m = mokgen.MoE(SHAPE, tokens_per_rank=256)
    ref = ReferenceMoE(SHAPE)
    ref.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    return m, ref


def test_state_dict_names_and_layouts_match_the_reference():
    m, ref = pair()
    assert m.state_dict().keys() == ref.state_dict().keys()
    for k, v in m.state_dict().items():
        assert v.shape == ref.state_dict()[k].shape, k
    m.load_state_dict({k: v.to(m.state_dict()[k].dtype) for k, v in ref.state_dict().items()})


def test_forward_matches_reference_module():
    m, ref = pair()
    x = torch.randn(3, 20, SHAPE.hidden).bfloat16().float()  # bf16-exact inputs
    assert rel(m(x), ref(x)) <= 1e-2
    assert m(x).shape == x.shape and m(x).dtype == x.dtype


def test_backward_matches_reference_autograd():
    m, ref = pair()
    x = torch.randn(40, SHAPE.hidden).bfloat16().float()
    xm, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn_like(x)
    m(xm).backward(dy)
    ref(xr).backward(dy)
    assert rel(xm.grad, xr.grad) <= 2e-2
    for name, p in m.named_parameters():
        want = dict(ref.named_parameters())[name].grad
        assert p.grad is not None and rel(p.grad, want) <= 2e-2, name


def test_fused_grad_accumulation_flag_keeps_cpu_gradients():
    """fuse_grad_accumulation is a CUDA-kernel path: on CPU (the reference) gradients
    accumulate through autograd exactly as without the flag, over several backward calls."""
    torch.manual_seed(0)
    plain = mokgen.MoE(SHAPE, tokens_per_rank=64, fuse_grad_accumulation=False)
    fused = mokgen.MoE(SHAPE, tokens_per_rank=64)  # the default (None): fused in one process
    fused.load_state_dict(plain.state_dict())
    for _ in range(2):
        x = torch.randn(24, SHAPE.hidden)
        dy = torch.randn_like(x)
        plain(x).backward(dy)
        fused(x).backward(dy)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert torch.equal(p.grad, q.grad), name
    # the layer's entry names its module as the owner of the gradients; a deep copy its copy
    twin = copy.deepcopy(fused)
    assert ops._entry(fused._layer)[4]() is fused and ops._entry(twin._layer)[4]() is twin
    assert ops._entry(plain._layer)[4] is None


def test_fused_accumulation_only_where_the_backward_accumulates_into_the_experts(monkeypatch):
    """The fused path adds into .grad only in a backward that accumulates into both expert
    weights and where no hook watches their gradient: torch.autograd.grad and
    backward(inputs=...) without them, or a hook on them, take autograd's path (the fused one
    would change a .grad the caller did not ask to change, return no gradient, skip the
    hook). _accumulate_into is called from a probe's backward, as the layer's backward calls
    it, with the CUDA kernels stood in (on CPU there are none)."""
    m = mokgen.MoE(SHAPE, tokens_per_rank=64, fuse_grad_accumulation=True)
    monkeypatch.setattr(ops, "_kernels", lambda layer, x, backward=False: object())
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w1, w2):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            acc = ops._accumulate_into(m._layer, g, m.w1, m.w2)
            seen.append(len(acc) == 2 and acc[0] is m.w1.grad and acc[1] is m.w2.grad)
            return g * 2.0, torch.zeros_like(m.w1), torch.zeros_like(m.w2)

    def fused(run):
        x = torch.randn(8, SHAPE.hidden, requires_grad=True)
        run(Probe.apply(x, m.w1, m.w2).sum(), x)
        return seen.pop()

    backward = lambda y, x: y.backward()  # noqa: E731
    assert not fused(backward)  # no .grad yet: nothing to add into
    m.w1.grad, m.w2.grad = torch.zeros_like(m.w1), torch.zeros_like(m.w2)
    assert fused(backward)
    assert not fused(lambda y, x: torch.autograd.grad(y, [x]))
    assert not fused(lambda y, x: torch.autograd.grad(y, [x, m.w1, m.w2]))
    assert not fused(lambda y, x: y.backward(inputs=[x, m.w1]))
    assert fused(lambda y, x: y.backward(inputs=[x, m.w1, m.w2]))
    h = m.w1.register_hook(lambda g: g)
    assert not fused(backward)
    h.remove()
    assert fused(backward)
    h = m.w2.register_post_accumulate_grad_hook(lambda p: None)
    assert not fused(backward)
    h.remove()
    assert fused(backward)


def test_fused_accumulation_not_while_traced(monkeypatch):
    """torch.compile's AOT autograd traces the layer's backward on functional tensors: the
    fused path (whose ops mutate .grad, and whose owner check reads data pointers) must step
    aside there, not raise (it did, on the GPU, once fusing became the default)."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    m = mokgen.MoE(SHAPE, tokens_per_rank=64, fuse_grad_accumulation=True)
    monkeypatch.setattr(ops, "_kernels", lambda layer, x, backward=False: object())
    m.w1.grad, m.w2.grad = torch.zeros_like(m.w1), torch.zeros_like(m.w2)
    with FunctionalTensorMode():  # what AOT autograd's trace hands the backward
        x, w1, w2 = (FunctionalTensor.to_functional(t) for t in
                     (torch.randn(8, SHAPE.hidden), m.w1.detach(), m.w2.detach()))
        assert ops._accumulate_into(m._layer, x, w1, w2) == ()


def test_fused_accumulation_by_default_only_without_a_process_group(tmp_path):
    """fuse_grad_accumulation=None (the default) fuses where no torch.distributed process
    group is initialized when the backward runs (DDP, whose hooks on the experts' gradient
    accumulation the layer cannot see, needs one); True fuses with one too; False never."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert ops.fuses(None) and ops.fuses(True) and not ops.fuses(False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        assert not ops.fuses(None) and ops.fuses(True) and not ops.fuses(False)
    finally:
        dist.destroy_process_group()
    assert ops.fuses(None)


def test_backward_op_passes_opcheck_with_and_without_accumulation_targets():
    m = mokgen.MoE(SHAPE, tokens_per_rank=64)
    x = torch.randn(12, SHAPE.hidden).bfloat16()
    logits = torch.randn(12, SHAPE.num_experts)
    weights, experts = torch.randn(12, SHAPE.num_experts).topk(SHAPE.topk)
    token = torch.tensor([-1])
    w = [t.detach() for t in (m.w1, m.w2, m.shared_w1, m.shared_w2)]
    args = (torch.randn_like(x), x, logits, experts.int(), weights.softmax(-1), token, *w)
    for op, acc in ((ops.moe_backward, ()),
                    (ops.moe_backward_into, (torch.randn_like(w[0]), torch.randn_like(w[1])))):
        torch.library.opcheck(op, (*args, *acc, [], m._layer),
                              test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph_captures_moe_layers():
    torch._dynamo.reset()
    model = torch.nn.Sequential(mokgen.MoE(SHAPE, tokens_per_rank=256), torch.nn.GELU(),
                                mokgen.MoE(SHAPE, tokens_per_rank=256))
    x = torch.randn(2, 16, SHAPE.hidden)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(x), model(x))


def test_custom_op_passes_opcheck():
    m = mokgen.MoE(SHAPE, tokens_per_rank=64)
    x = torch.randn(12, SHAPE.hidden).bfloat16()
    logits = torch.randn(12, SHAPE.num_experts)
    args = (x, logits, m.w1.detach(), m.w2.detach(), m.shared_w1.detach(),
            m.shared_w2.detach(), m._layer)
    torch.library.opcheck(ops.moe_forward, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("make,exc,match", [
    (lambda m: m(torch.randn(4, SHAPE.hidden + 1)), ValueError, r"x must have shape"),
    (lambda m: m([1.0]), TypeError, r"x must be a torch.Tensor"),
    (lambda m: m(torch.randn(300, SHAPE.hidden)), ValueError, r"tokens_per_rank=256"),
    (lambda m: m(torch.randn(4, SHAPE.hidden), torch.randn(4, 16)), ValueError, "router_logits"),
])
def test_forward_rejects_bad_input(make, exc, match):
    with pytest.raises(exc, match=match):
        make(mokgen.MoE(SHAPE, tokens_per_rank=256))


def test_router_free_layer_needs_logits():
    m = mokgen.MoE(SHAPE, tokens_per_rank=64, router=False)
    with pytest.raises(ValueError, match="exactly one of router_logits or routes"):
        m(torch.randn(4, SHAPE.hidden))
    assert m(torch.randn(4, SHAPE.hidden), torch.randn(4, 16)).shape == (4, SHAPE.hidden)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(shape="small"), TypeError, "shape must be a mokgen.MoEShape"),
    (dict(dtype="int8"), ValueError, "dtype"),
    (dict(tokens_per_rank=-1), ValueError, "tokens_per_rank"),
    (dict(bogus=3), ValueError, "bogus"),
])
def test_constructor_rejects_bad_arguments(kw, exc, match):
    args = dict(shape=SHAPE, tokens_per_rank=64) | kw
    with pytest.raises(exc, match=match):
        mokgen.MoE(**args)


def test_routes_from_the_caller_match_reference_and_carry_weight_gradients():
    m = mokgen.MoE(SHAPE, tokens_per_rank=64, router=False)
    x = torch.randn(30, SHAPE.hidden).bfloat16().float()
    logits = torch.randn(30, SHAPE.num_experts)
    experts = torch.sigmoid(logits).topk(SHAPE.topk, dim=-1).indices       # sigmoid scoring
    wts = (torch.sigmoid(logits).gather(1, experts) * 2.5).requires_grad_()  # scaled, unnormed
    y = m(x, routes=(experts, wts))
    f = [t.detach().float() for t in (m.w1, m.w2, m.shared_w1, m.shared_w2)]
    want = mokgen.reference.moe_forward_routed(x, experts, wts.detach(), *f)
    assert rel(y, want) <= 1e-2  # the layer computes in bf16 (its parameters' dtype)
    dy = torch.randn_like(y)
    y.backward(dy)
    wref = wts.detach().clone().requires_grad_()
    mokgen.reference.moe_forward_routed(x, experts, wref, *f).backward(dy)
    assert rel(wts.grad, wref.grad) <= 1e-2
    with pytest.raises(ValueError, match="shape"):
        m(x, routes=(experts[:, :1], wts[:, :1]))
    with pytest.raises(TypeError, match="int32 or int64"):
        m(x, routes=(experts.float(), wts))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_fp8_layer_on_cpu_quantizes_like_the_kernels(fmt):
    """An fp8 layer's reference path (CPU) multiplies the operands quantized as the fp8
    kernels do: equal to the quantized reference, measurably off the exact one."""
    shape = mokgen.MoEShape(8, 256, 128, 2, name="fp8-tiny")
    m = mokgen.MoE(shape, dtype=fmt, tokens_per_rank=64)
    ref = ReferenceMoE(shape)
    ref.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    x = torch.randn(50, shape.hidden).bfloat16().float()
    y = m(x)
    want = mokgen.reference.moe_forward(x, ref.router(x), ref.w1, ref.w2, ref.shared_w1,
                                        ref.shared_w2, shape.topk, fp8=fmt)
    assert rel(y, want) <= 1e-2
    assert rel(y, ref(x)) > 5e-3


def test_overlap_comm_reserves_sms_in_the_layers_plan():
    assert mokgen.MoE(SHAPE, tokens_per_rank=256).plan.reserve_sms == 0
    m = mokgen.MoE(SHAPE, tokens_per_rank=256, overlap_comm=True)
    from mokgen.compiler.passes.sm_partition import collective_sms

    reserve, sms = collective_sms(m.plan.target), m.plan.gpu_sms  # the H200's: 16 of 132
    assert m.plan.overlap_comm and m.plan.reserve_sms == reserve and m.plan.num_sms == sms - reserve
    assert mokgen.MoE(SHAPE, tokens_per_rank=256, overlap_comm=True,
                      reserve_sms=8).plan.num_sms == sms - 8


@pytest.mark.parametrize("routed", [False, True])
def test_eager_calls_skip_the_dispatcher_and_equal_the_ops_bitwise(routed, monkeypatch):
    """A plain eager call runs the custom op's body under an autograd.Function (ops.moe /
    ops.moe_routed: no dispatcher, ~1 ms of host a GPU step): its output and every gradient
    (x, router or route weights, experts, shared expert) are bitwise the ops'; the op itself
    is not reached, unless a torch-function mode is active (then it is)."""
    def step(eager):
        torch.manual_seed(0)
        m = mokgen.MoE(SHAPE, tokens_per_rank=64, router=not routed)
        x = torch.randn(40, SHAPE.hidden, requires_grad=True)
        z = torch.randn(40, SHAPE.num_experts, requires_grad=True)
        with monkeypatch.context() as mp:
            if not eager:
                mp.setattr(ops, "_plain_eager", lambda tensors: False)
            w = z.softmax(-1).topk(SHAPE.topk)
            y = m(x, routes=(w.indices, w.values)) if routed else m(x)
            (y * torch.randn_like(y)).sum().backward()
        return [y, x.grad, z.grad] + [p.grad for p in m.parameters()]

    op = ops.moe_forward_routed if routed else ops.moe_forward
    reached = []
    real = type(op).__call__
    monkeypatch.setattr(type(op), "__call__",
                        lambda self, *a, **k: reached.append(self) or real(self, *a, **k))
    got = step(True)
    assert op not in reached, "a plain eager call went through the custom op"
    want = step(False)
    assert op in reached
    assert len(got) == len(want) and all(
        (a is None and b is None) or torch.equal(a, b) for a, b in zip(got, want))
    assert got[0].requires_grad and (got[2] is not None) == routed

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert not ops._plain_eager([torch.ones(1)])
    assert ops._plain_eager([torch.ones(1), torch.nn.Parameter(torch.ones(1)), None])


@pytest.mark.parametrize("reentrant", [False, True])
def test_eager_calls_under_activation_checkpointing_equal_plain_calls(reentrant):
    """The eager path (an autograd.Function, not the op) under torch.utils.checkpoint, both
    kinds: the output and every gradient bitwise those of a plain call."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m = mokgen.MoE(SHAPE, tokens_per_rank=64)
    x = torch.randn(40, SHAPE.hidden)
    dy = torch.randn_like(x)
    runs = []
    for ckpt in (False, True):
        m.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        y = checkpoint(m, xg, use_reentrant=reentrant) if ckpt else m(xg)
        y.backward(dy)
        runs.append([y, xg.grad] + [p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_memory_before_any_cuda_call_has_the_compiled_layers_keys_at_zero():
    """docs/api.md: MoE.memory() is the compiled layer's report, zeros before the first CUDA
    call: the same keys (CompiledMoE.memory), so code reading it runs on CPU too."""
    m = mokgen.MoE(SHAPE, tokens_per_rank=256)
    m(torch.randn(8, SHAPE.hidden))  # a CPU call: the reference, no kernels
    assert m.memory() == {"workspace": 0, "workspace_held": 0, "layers_sharing": 0,
                          "saved_per_call": 0}
