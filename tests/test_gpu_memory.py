"""A model, not a layer (gpu): one workspace per plan and device shared by every layer, layers
released with their modules, activation checkpointing without replay, ep = 1 without a
process group."""
import gc

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import mokgen
from mokgen.harness.workloads import cosine, make_inputs, reference_outputs, rel_error

pytestmark = pytest.mark.gpu
SHAPE = mokgen.shapes.get("gpu-small")
TOKENS = 512


class Stack(nn.Module):
    """Residual MoE layers (router included), optionally each under activation checkpointing."""

    def __init__(self, layers, ckpt=False, backend="kernels", **options):
        super().__init__()
        self.moes = nn.ModuleList(mokgen.MoE(SHAPE, tokens_per_rank=TOKENS, backend=backend,
                                             **options)
                                  for _ in range(layers))
        self.ckpt = ckpt

    def forward(self, h):
        for moe in self.moes:
            h = h + (checkpoint(moe, h, use_reentrant=False) if self.ckpt else moe(h))
        return h


def step(model, x, dy):
    """One training step's gradients (x's and every parameter's), by name."""
    model.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_()
    model(xg).backward(dy)
    out = {"x": xg.grad}
    out.update({n: p.grad for n, p in model.named_parameters()})
    return out


def runtime_of(moe):
    return mokgen.pytorch.ops.kernels_of(moe._layer).compiled.runtime()


def warm_cublas():
    """cuBLAS allocates its workspaces (one per thread: ours and autograd's backward thread)
    from torch's allocator on first use and keeps them: take them before measuring."""
    model = Stack(1, backend="reference").cuda()
    x = torch.randn(8, SHAPE.hidden, device="cuda", dtype=torch.bfloat16)
    step(model, x, torch.randn_like(x))
    torch.cuda.synchronize()


def test_layers_share_one_workspace_and_it_goes_with_the_last():
    """One workspace for the four layers, allocated during their calls only."""
    warm_cublas()
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    model = Stack(4).cuda()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(300, SHAPE.hidden, device="cuda", dtype=torch.bfloat16)
    step(model, x, torch.randn_like(x))
    torch.cuda.synchronize()
    reports = [m.memory() for m in model.moes]
    assert all(r["layers_sharing"] == 4 for r in reports)
    assert len({r["workspace"] for r in reports}) == 1 and reports[0]["workspace"] > 0
    assert len({id(runtime_of(m)) for m in model.moes}) == 1
    plan_ws = mokgen.pytorch.api.memory_report(model.moes[0].plan)["workspace"]
    # one rank hosted without staging: the plan's per-rank figure less the staged x and dy
    staged = 2 * TOKENS * SHAPE.hidden * 2
    assert reports[0]["workspace"] == plan_ws["total"] - staged
    # between steps the workspace is back in PyTorch's cache (one real rank releases it)
    held = torch.cuda.memory_allocated() - base - 2 * params  # weights and their grads
    assert all(r["workspace_held"] == 0 for r in reports)
    assert held < 8 * 2**20, "the workspace (or one per layer) held between steps"
    step(model, x, torch.randn_like(x))  # taken back from the cache: the same bytes again
    assert model.moes[0].memory()["workspace"] == reports[0]["workspace"]
    del model, reports, x
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base, "the workspace outlived its layers"


def test_checkpointed_stack_replays_nothing_and_matches_bitwise():
    """keep_h=False (h in the shared ring): without checkpointing the non-last layers replay,
    checkpointed none does, with bitwise the same gradients. (The default, keep_h, replays
    nothing either way: test_keep_h_checkpointed_frees_the_kept_h_and_matches_bitwise.)"""
    torch.manual_seed(0)
    plain = Stack(3, keep_h=False).cuda()
    ckpt = Stack(3, ckpt=True, keep_h=False).cuda()
    ckpt.load_state_dict(plain.state_dict())
    ref = Stack(3, backend="reference").cuda()
    ref.load_state_dict(plain.state_dict())
    x = torch.randn(TOKENS, SHAPE.hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    step(plain, x, dy)  # builds the kernels and the workspace
    step(ckpt, x, dy)
    rt = runtime_of(plain.moes[0])
    assert rt is runtime_of(ckpt.moes[0]), "one plan, one workspace"
    before = dict(rt.stats)
    g_plain = step(plain, x, dy)
    mid = dict(rt.stats)
    g_ckpt = step(ckpt, x, dy)
    after = dict(rt.stats)
    torch.cuda.synchronize()
    # without checkpointing only the last layer finds its forward in the ring
    assert mid["backward"] - before["backward"] == 3 and mid["replayed"] - before["replayed"] == 2
    # checkpointed: each layer's forward re-runs right before its backward: no replay
    assert after["backward"] - mid["backward"] == 3 and after["replayed"] == mid["replayed"]
    for k, g in g_plain.items():
        assert torch.equal(g, g_ckpt[k]), f"{k}: checkpointed gradient differs"
    # against fp32 experts, a sanity check (each layer's accuracy is test_gpu_backward's):
    # three layers of a bf16 residual stream compound the rounding, and the routers'
    # gradients most (measured on H200: cosine >= 0.997, rel. error up to 0.074)
    g_ref = step(ref, x, dy)
    for k, g in g_plain.items():
        assert cosine(g, g_ref[k]) >= 0.99 and rel_error(g, g_ref[k]) <= 0.15, k


def test_keep_h_checkpointed_frees_the_kept_h_and_matches_bitwise():
    """keep_h under activation checkpointing: a call's kept h is a saved tensor of its custom
    op, so the checkpoint frees it with the forward (what the forwards leave allocated is
    lower by at least every layer's kept bytes) and the backward gets the re-run forward's:
    gradients bitwise those of the same stack without checkpointing, nothing replayed."""
    from mokgen.compiler.lower import layer_spec
    from mokgen.runtime.workspace import KeptActivations

    torch.manual_seed(0)
    plain = Stack(3).cuda()  # keep_h: the default at ep 1 in bf16 (passes/keep_h.py)
    ckpt = Stack(3, ckpt=True).cuda()
    assert plain.moes[0].plan.keep_h
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(TOKENS, SHAPE.hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    step(plain, x, dy)  # builds the kernels and the workspace
    step(ckpt, x, dy)
    kept = 2 * sum(a * b for a, b in KeptActivations.shapes(layer_spec(plain.moes[0].plan),
                                                          TOKENS))

    def forward_held(model):
        """(bytes the forward leaves allocated, the step's gradients)."""
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        xg = x.clone().requires_grad_()
        y = model(xg)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        y.backward(dy)
        return held, {"x": xg.grad, **{n: p.grad for n, p in model.named_parameters()}}

    rt = runtime_of(plain.moes[0])
    before = dict(rt.stats)
    held_plain, g_plain = forward_held(plain)
    mid = dict(rt.stats)
    held_ckpt, g_ckpt = forward_held(ckpt)
    torch.cuda.synchronize()
    assert rt.stats["replayed"] == before["replayed"], "a keep_h backward replayed"
    # the last layer alone finds its forward in the ring without checkpointing; checkpointed,
    # every layer's re-run forward is: the resident twin's kernel (plan.resident_twin)
    assert mid["resident_kernel"] - before["resident_kernel"] == 1
    assert rt.stats["resident_kernel"] - mid["resident_kernel"] == 3
    assert held_plain - held_ckpt >= 3 * kept, (held_plain, held_ckpt, kept)
    for k, g in g_plain.items():
        assert torch.equal(g, g_ckpt[k]), f"{k}: checkpointed gradient differs"


@pytest.mark.parametrize("routing", ["router", "caller-int64"])
def test_interleaved_layers_are_deterministic(routing):
    """Layer A's output and gradients do not depend on what another layer sharing its
    workspace ran in between (then A's backward re-schedules from its saved routes: a
    caller's int64 experts must reach the kernels as int32)."""
    own = routing == "router"
    a, b = (mokgen.MoE(SHAPE, tokens_per_rank=TOKENS, router=own).cuda() for _ in range(2))
    x = torch.randn(TOKENS, SHAPE.hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    scores = torch.randn(TOKENS, SHAPE.num_experts, device="cuda").softmax(-1)
    w, e = scores.topk(SHAPE.topk, dim=-1)  # int64 experts, as a model's router gives them
    wts = (w / w.sum(-1, keepdim=True)).requires_grad_()
    kw = {} if own else {"routes": (e, wts)}

    def run(layer, interleave):
        layer.zero_grad(set_to_none=True)
        wts.grad = None
        xg = x.clone().requires_grad_()
        y = layer(xg, **kw)
        if interleave:
            b(x.clone().requires_grad_(), **kw).sum()  # overwrites the shared ring
        y.backward(dy)
        extra = [] if own else [wts.grad]
        return [y.detach(), xg.grad, *extra, *[p.grad for p in layer.parameters()]]

    alone, between = run(a, False), run(a, True)
    for u, v in zip(alone, between):
        assert torch.equal(u, v)


def test_ep1_without_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    layer = mokgen.compile(SHAPE, ep=1, tokens_per_rank=TOKENS)  # virtual=False: one real rank
    inputs = make_inputs(SHAPE, 1, 400)
    y = layer(inputs["x"][0], inputs["router_logits"][0], inputs["w1"][0], inputs["w2"][0],
              inputs["shared_w1"], inputs["shared_w2"])
    assert rel_error(y, reference_outputs(SHAPE, inputs)[0]) <= 1e-2


@pytest.mark.parametrize("routed,ckpt", [(False, False), (True, False), (False, True)],
                         ids=["router", "caller-routes", "router-checkpointed"])
def test_fused_grad_accumulation(routed, ckpt):
    """fuse_grad_accumulation (the default, in one process): over micro-batches the kernel
    adds the expert gradients into .grad (TMA reductions of whole experts' tiles, or one
    rounding from fp32 where an expert's rows span ring passes), autograd adds nothing for
    them: the same sums as the ordinary path within bf16 rounding and as the reference,
    bitwise repeatable, the other gradients bitwise unchanged, and no expert-gradient-sized
    temporary in the step's peak; also under activation checkpointing (whose saved weights
    are detached aliases)."""
    torch.manual_seed(0)
    plain = mokgen.MoE(SHAPE, tokens_per_rank=TOKENS, device="cuda", router=not routed,
                       fuse_grad_accumulation=False)
    fused = mokgen.MoE(SHAPE, tokens_per_rank=TOKENS, device="cuda", router=not routed)
    assert fused.fuse_grad_accumulation is None  # the default: fused in one process
    fused.load_state_dict(plain.state_dict())
    ref = mokgen.MoE(SHAPE, tokens_per_rank=TOKENS, device="cuda", router=not routed,
                     backend="reference")
    ref.load_state_dict(plain.state_dict())
    micro = [torch.randn(TOKENS, SHAPE.hidden, device="cuda", dtype=torch.bfloat16)
             for _ in range(3)]
    dys = [torch.randn_like(x) for x in micro]
    routes = [(torch.randn(TOKENS, SHAPE.num_experts, device="cuda").topk(SHAPE.topk)[1],
               torch.rand(TOKENS, SHAPE.topk, device="cuda") + 0.1) for _ in micro]
    expert_bytes = 2 * (plain.w1.numel() + plain.w2.numel())

    def run(moe):
        moe.zero_grad(set_to_none=True)
        dxs, peaks = [], []
        for i, (x, dy) in enumerate(zip(micro, dys)):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            xg = x.clone().requires_grad_()
            kw = {"routes": routes[i]} if routed else {}
            y = checkpoint(moe, xg, use_reentrant=False, **kw) if ckpt else moe(xg, **kw)
            y.backward(dy)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - before)
            dxs.append(xg.grad)
        grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
        return dxs, grads, peaks

    p_dx, p_g, p_peaks = run(plain)
    f_dx, f_g, f_peaks = run(fused)
    f2_dx, f2_g, _ = run(fused)
    r_dx, r_g, _ = run(ref)
    for a, b in zip(p_dx, f_dx):
        assert torch.equal(a, b), "dx must not depend on how weight gradients accumulate"
    for n in p_g:
        assert torch.equal(f_g[n], f2_g[n]), f"{n}: fused accumulation not repeatable"
        if n in ("w1", "w2"):  # (that the fused path ran: the peaks below)
            assert rel_error(f_g[n], p_g[n]) < 1e-2, n
            assert cosine(f_g[n], r_g[n]) > 0.9999, n
        else:  # router and shared expert: autograd's as before
            assert torch.equal(f_g[n], p_g[n]), n
    # micro-batches 2 and 3 add in place: no temporary the size of the expert gradients
    for i in (1, 2):
        assert f_peaks[i] <= p_peaks[i] - 0.9 * expert_bytes, (i, f_peaks, p_peaks)


def test_fused_grad_accumulation_leaves_grad_alone_under_autograd_grad():
    """With .grad already holding gradients, torch.autograd.grad through a layer that fuses
    accumulation returns the expert gradients (the ordinary path's, bitwise) and leaves
    .grad as it was; the next backward() fuses again (no expert-sized temporary)."""
    torch.manual_seed(1)
    plain = mokgen.MoE(SHAPE, tokens_per_rank=TOKENS, device="cuda",
                       fuse_grad_accumulation=False)
    fused = mokgen.MoE(SHAPE, tokens_per_rank=TOKENS, device="cuda")
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(TOKENS, SHAPE.hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    fused(x).backward(dy)  # .grad now set: later backward() calls may fuse
    held = {n: p.grad.clone() for n, p in fused.named_parameters()}
    want = torch.autograd.grad(plain(x), [plain.w1, plain.w2], dy)
    got = torch.autograd.grad(fused(x), [fused.w1, fused.w2], dy)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for n, p in fused.named_parameters():
        assert torch.equal(p.grad, held[n]), f"{n}.grad changed by autograd.grad"
    plain(x).backward(dy)  # so both hold .grad before the measured backward

    def peak(moe):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        moe(x).backward(dy)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    expert_bytes = 2 * (fused.w1.numel() + fused.w2.numel())
    assert peak(fused) <= peak(plain) - 0.9 * expert_bytes  # fused again after autograd.grad
    assert not torch.equal(fused.w1.grad, held["w1"])  # added into in place
