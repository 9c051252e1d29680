"""The backward megakernel on the GPU against reference autograd (marked gpu)."""
import gc
import os
import subprocess

import pytest
import torch

import mokgen
from mokgen.compiler.lower import layer_spec
from mokgen.pytorch.api import memory_report
from mokgen.compiler.ir import GemmConfig
from mokgen.compiler.lower import smem_bytes
from mokgen.harness.workloads import cosine, make_inputs, reference_grads, rel_error

pytestmark = pytest.mark.gpu
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
NAMES = ("x", "router_logits", "w1", "w2")


def grads_of(layer, inputs, dys):
    """Our gradients through autograd over the compiled layer (virtual ranks)."""
    leaves = {k: [t.detach().clone().requires_grad_() for t in inputs[k]] for k in NAMES}
    shared = {k: None if inputs[k] is None else inputs[k].detach().clone().requires_grad_()
              for k in ("shared_w1", "shared_w2")}
    ys = layer(**leaves, **shared)
    torch.autograd.backward(ys, dys)
    out = {k: [t.grad for t in v] for k, v in leaves.items()}
    out.update({k: None if t is None else t.grad for k, t in shared.items()})
    return out


def stale_grads(layer, shape, inputs, dys, replays: bool = True):
    """grads_of with another forward between the forward and its backward: the ring no
    longer holds its rows, so the backward re-schedules and replays every minibatch (`replays`;
    a keep_h layer's backward replays nothing: it pulls x onto its kept h)."""
    leaves = {k: [t.detach().clone().requires_grad_() for t in inputs[k]] for k in NAMES}
    shared = {k: None if inputs[k] is None else inputs[k].detach().clone().requires_grad_()
              for k in ("shared_w1", "shared_w2")}
    ys = layer(**leaves, **shared)
    with torch.no_grad():
        layer(**make_inputs(shape, len(inputs["x"]), inputs["x"][0].shape[0]))
    replayed = layer.runtime().stats["replayed"]
    torch.autograd.backward(ys, dys)
    assert layer.runtime().stats["replayed"] == replayed + int(replays)
    out = {k: [t.grad for t in v] for k, v in leaves.items()}
    out.update({k: None if t is None else t.grad for k, t in shared.items()})
    return out


def _equal_grads(a, b, what):
    for k, v in a.items():
        for g, h in zip(*(x if isinstance(x, list) else [x] for x in (v, b[k]))):
            assert (g is None and h is None) or torch.equal(g, h), f"{k}: {what}"


def check(ours, ref):
    bad = []
    for k, want in ref.items():
        if want is None:
            assert ours[k] is None
            continue
        pairs = zip(ours[k], want) if isinstance(want, list) else [(ours[k], want)]
        for r, (g, w) in enumerate(pairs):
            if g is None or not torch.isfinite(g).all():
                bad.append(f"{k}[{r}]: missing or not finite")
                continue
            c, e = cosine(g, w), rel_error(g, w)
            if not (c >= 0.9999 and e <= 2e-2):
                bad.append(f"{k}[{r}]: cosine {c:.6f}, rel {e:.3e}")
    assert not bad, "; ".join(bad)


def run_backward(shape, ep, tokens, skew=None, **overrides):
    layer = mokgen.compile(shape, ep=ep, tokens_per_rank=tokens, virtual=True, **overrides)
    inputs = make_inputs(shape, ep, tokens, skew=skew)
    dys = [torch.randn_like(x) for x in inputs["x"]]
    layer.runtime().poison()
    layer.backward_runtime().poison()
    ours = grads_of(layer, inputs, dys)
    torch.cuda.synchronize()
    layer.synchronize()
    check(ours, reference_grads(shape, inputs, dys))
    return layer, inputs, dys, ours


@pytest.mark.parametrize("ep,tokens", [(1, 1000), (2, 1000), (4, 777), (8, 513)])
def test_backward_virtual_ranks(ep, tokens):
    run_backward(mokgen.shapes.get("gpu-small"), ep, tokens)


def test_backward_ring_replay_and_wrap():
    # ~3600 rows per rank through a 256-row ring: most minibatches are replayed
    run_backward(mokgen.shapes.get("gpu-small"), 4, 900, minibatch=128, macrobatch=256)


# "one-soft": almost every token's first route goes to expert 0, which then spans many
# minibatches (its weight gradient is summed over many segments). ("one", with a +100 logit
# margin, makes the other routes' weights ~1e-44 and the logits' gradient pure rounding.)
@pytest.mark.parametrize("skew", ["one-soft", "sparse"])
def test_backward_skewed_routing(skew):
    run_backward(mokgen.shapes.get("gpu-small"), 4, 600, skew=skew, minibatch=256,
                 macrobatch=512)


@pytest.mark.parametrize("skew", [None, "one-soft"])
def test_backward_running_sums_by_minibatch(skew):
    """A ring smaller than the rows and more local experts than minibatches: the fp32 weight-
    gradient sums are kept per minibatch an expert starts in (workspace.LayerSpec.
    wg_by_minibatch), not per expert; "one-soft" makes expert 0 span most minibatches."""
    shape = mokgen.shapes.get("gpu-small")
    kw = dict(minibatch=256, macrobatch=512)
    spec = layer_spec(mokgen.plan(shape, ep=1, tokens_per_rank=1000, **kw))
    assert spec.needs_wg_acc and spec.wg_by_minibatch and spec.wg_acc_slots < spec.local_experts
    run_backward(shape, 1, 1000, skew=skew, **kw)


def test_weight_gradients_leave_through_tma_where_the_kernel_can():
    """bf16 kernels store whole-expert weight-gradient tiles with TMA (moe_bwd.cuh kTmaWgrad,
    read back as BackwardPass.wgrad_tma), edge widths too (3D maps: an edge row tile stops at
    its expert's last row); fp8 kernels (no shared memory to spare) keep the register stores.
    Poisoned runs (NaN-filled outputs) check every element: this file's, and
    test_gpu_widths.py's and test_gpu_pair.py's edge widths."""
    gs = mokgen.shapes.get("gpu-small")
    edge = mokgen.MoEShape(8, 1040, 720, 2, shared_intermediate=336)
    on = [mokgen.compile(gs, ep=2, tokens_per_rank=300, virtual=True),
          mokgen.compile(edge, ep=2, tokens_per_rank=300, virtual=True)]
    off = mokgen.compile(gs, ep=2, tokens_per_rank=300, virtual=True, dtype="fp8")
    assert all(layer.backward_runtime().wgrad_tma for layer in on)
    assert not off.backward_runtime().wgrad_tma
    run_backward(edge, 2, 300)  # M and N edge tiles through the 3D maps


@pytest.mark.parametrize("shape,skew,ring", [
    (mokgen.MoEShape(32, 1024, 512, 8, shared_experts=1, shared_intermediate=256), None, {}),
    (mokgen.MoEShape(20, 2880, 704, 6, shared_experts=0), None, {}),  # edge dx tiles
    # skewed routes: expert 0's rows span many minibatches (its dW2 listed with the last)
    (mokgen.shapes.get("gpu-small"), "one-soft", dict(minibatch=256))])
def test_dx_rows_in_the_dy_ring_equal_the_pushed_ones(shape, skew, ring):
    """reverse_dispatch "ring" (one rank's default where the ring holds every minibatch: the
    dx tiles run last and write over their dy rows): right against the reference, bitwise
    repeatable, every gradient bitwise the pushed rows' backward's, a smaller workspace."""
    tokens = 1000
    ring = dict(ring, keep_h=False)  # h in the ring: the stale call below replays
    layer, inputs, dys, ours = run_backward(shape, 1, tokens, skew=skew, **ring)
    assert layer.plan.reverse_dispatch == "ring"
    _equal_grads(ours, grads_of(layer, inputs, dys), "not repeatable")
    _equal_grads(ours, stale_grads(layer, shape, inputs, dys), "the stale ring's differs")
    pushed_layer = mokgen.compile(shape, ep=1, tokens_per_rank=tokens, virtual=True,
                                  reverse_dispatch="push", **ring)
    assert pushed_layer.plan.reverse_dispatch == "push"
    pushed = grads_of(pushed_layer, inputs, dys)
    for k, v in ours.items():
        for a, b in zip(*(x if isinstance(x, list) else [x] for x in (v, pushed[k]))):
            assert (a is None and b is None) or torch.equal(a, b), \
                f"{k}: differs from the pushed rows' backward"
    # the workspace smaller by what the plans' reports say (the report also counts x / dy
    # staging that virtual ranks do without: the same bytes in both)
    got = [m.memory()["workspace"] for m in (layer, pushed_layer)]
    want = [memory_report(m.plan)["workspace"]["total"] for m in (layer, pushed_layer)]
    assert got[1] - got[0] == want[1] - want[0] > 0


# Small minibatches, so the window wraps many times: skewed routes (expert 0 over most of the
# window: its dW1 reads x rows across a wrap, and slots wait on it), and widths with K and
# edge tails plus a shared expert.
@pytest.mark.parametrize("shape,skew,tokens", [
    (mokgen.shapes.get("gpu-small"), "one-soft", 1500),
    (mokgen.MoEShape(20, 2880, 704, 6, shared_experts=1, shared_intermediate=256), None, 700)])
def test_x_window_equals_the_whole_x_ring_bitwise(shape, skew, tokens):
    """A forward that gathers x (dispatch "gather", reverse_combine "pull"): the backward's
    comm CTAs copy x into a window of a few minibatch slots (passes/x_window.py), refilled
    once the dW1 tiles of each expert in a slot are done. Right against the reference,
    bitwise repeatable, every gradient bitwise the whole x ring's (x_slots forced to the
    ring's slots), a stale ring's (another forward in between: the replay reads x from the
    window) likewise, and the workspace smaller by the plans' reports' difference."""
    kw = dict(dispatch="gather", reverse_combine="pull", minibatch=256)
    win, inputs, dys, ours = run_backward(shape, 1, tokens, skew=skew, **kw)
    p = win.plan
    assert p.x_slots is not None and p.x_slots < p.ring_slots
    assert layer_spec(p).x_rows == p.x_slots * p.minibatch
    _equal_grads(ours, grads_of(win, inputs, dys), "not repeatable")
    whole = mokgen.compile(shape, ep=1, tokens_per_rank=tokens, virtual=True,
                           x_slots=p.ring_slots, **kw)
    assert layer_spec(whole.plan).x_slots == 0
    whole.runtime().poison()
    whole.backward_runtime().poison()
    _equal_grads(ours, grads_of(whole, inputs, dys), "differs from the whole x ring's")
    # stale: the ring no longer holds this forward's rows, so every minibatch is replayed
    _equal_grads(ours, stale_grads(win, shape, inputs, dys), "the stale ring's backward differs")
    got = [m.memory()["workspace"] for m in (win, whole)]
    want = [memory_report(m.plan)["workspace"]["total"] for m in (win, whole)]
    assert got[1] - got[0] == want[1] - want[0] > 0


@pytest.mark.parametrize("shape,skew,tokens", [
    (mokgen.shapes.get("gpu-small"), "one-soft", 1500),
    (mokgen.MoEShape(20, 2880, 704, 6, shared_experts=1, shared_intermediate=256), None, 700)])
def test_keep_h_never_replays_and_equals_the_default_bitwise(shape, skew, tokens):
    """keep_h (the default at ep 1 in bf16): each call keeps its own h (and the shared
    expert's activations), so a backward after other forwards of the same workspace replays
    nothing; it pulls x. Right against the reference, every gradient bitwise the keep_h=False
    plan's (whose ring held the forward),
    bitwise again with two other forwards between the forward and its backward (the
    replay count unchanged), and the workspace smaller by the plans' reports' difference."""
    kw = dict(minibatch=256)
    kept, inputs, dys, ours = run_backward(shape, 1, tokens, skew=skew, **kw)  # the default
    assert kept.plan.keep_h and kept.runtime().ranks[0].ring_h is None
    # nothing ran between that forward and its backward: the resident twin's kernel
    # (plan.resident_twin, the default plan's backward on the kept h) ran it
    assert kept.runtime().stats["resident_kernel"] == 1
    base = mokgen.compile(shape, ep=1, tokens_per_rank=tokens, virtual=True, keep_h=False, **kw)
    _equal_grads(ours, grads_of(base, inputs, dys), "differs from the h-in-the-ring plan's")
    # two forwards of other inputs (one differentiable, its backward after) in between
    leaves = {k: [t.detach().clone().requires_grad_() for t in inputs[k]] for k in NAMES}
    shared = {k: None if inputs[k] is None else inputs[k].detach().clone().requires_grad_()
              for k in ("shared_w1", "shared_w2")}
    ys = kept(**leaves, **shared)
    other = make_inputs(shape, 1, tokens)
    other_leaves = {k: [t.detach().clone().requires_grad_() for t in other[k]] for k in NAMES}
    other_ys = kept(**other_leaves, **{k: other[k] for k in ("shared_w1", "shared_w2")})
    with torch.no_grad():
        kept(**make_inputs(shape, 1, tokens))
    replayed = kept.runtime().stats["replayed"]
    torch.autograd.backward(ys, dys)
    other_dys = [torch.randn_like(y) for y in other_ys]
    torch.autograd.backward(other_ys, other_dys)
    assert kept.runtime().stats["replayed"] == replayed
    assert kept.runtime().stats["resident_kernel"] == 1  # both pulled x: the plan's kernel
    late = {k: [t.grad for t in v] for k, v in leaves.items()}
    late.update({k: None if t is None else t.grad for k, t in shared.items()})
    _equal_grads(ours, late, "differs after other forwards")
    # the other call's routed gradients, after a backward of the workspace in between
    ref = reference_grads(shape, other, other_dys)
    check({k: [t.grad for t in other_leaves[k]] for k in NAMES}, {k: ref[k] for k in NAMES})
    got = [m.memory()["workspace"] for m in (kept, base)]
    want = [memory_report(m.plan)["workspace"]["total"] for m in (kept, base)]
    assert got[1] - got[0] == want[1] - want[0] > 0


@pytest.mark.parametrize("skew", [None, "one-soft"])
def test_keep_h_call_with_fewer_tokens_keeps_fewer_rows(skew):
    """A keep_h layer planned for 1500 tokens called with 200: the call keeps only the ring
    rows 200 tokens can fill (KeptActivations.kept_rows, well under the ring), and its
    gradients are right against the reference and bitwise the keep_h=False plan's (poisoned
    outputs, skewed routes: one expert's region spans most of those rows)."""
    from mokgen.runtime.workspace import KeptActivations

    shape = mokgen.shapes.get("gpu-small")
    kw = dict(ep=1, tokens_per_rank=1500, virtual=True, minibatch=256)
    kept, plain = (mokgen.compile(shape, **kw, **o) for o in ({}, {"keep_h": False}))
    assert kept.plan.keep_h and not plain.plan.keep_h
    rows = KeptActivations.kept_rows(layer_spec(kept.plan), 200)
    assert rows < kept.plan.macrobatch // 2
    inputs = make_inputs(shape, 1, 200, skew=skew)
    dys = [torch.randn_like(x) for x in inputs["x"]]
    for m in (kept, plain):
        m.runtime().poison()
        m.backward_runtime().poison()
    ours = grads_of(kept, inputs, dys)
    torch.cuda.synchronize()
    check(ours, reference_grads(shape, inputs, dys))
    _equal_grads(ours, grads_of(plain, inputs, dys), "differs from the h-in-the-ring plan's")
    assert kept.runtime().stats["replayed"] == 0


def test_keep_h_modules_through_the_custom_ops():
    """mokgen.MoE with keep_h, two layers sharing one workspace, both forwards before both
    backwards, routed by mokgen from logits and by the caller's routes (the two forward ops):
    every gradient bitwise each layer's own with the default plan run alone (its forward
    resident), and no backward replayed."""
    shape = mokgen.MoEShape(32, 1024, 512, 8, shared_experts=1, shared_intermediate=256)
    T = 900
    mods = {kh: [mokgen.MoE(shape, tokens_per_rank=T, router=False, device="cuda",
                            keep_h=kh, minibatch=256) for _ in range(2)] for kh in (True, False)}
    for a, b in zip(mods[True], mods[False]):
        b.load_state_dict(a.state_dict())
    xs = [torch.randn(T, shape.hidden, device="cuda").bfloat16() for _ in range(2)]
    dys = [torch.randn_like(x) for x in xs]
    logits = [torch.randn(T, shape.num_experts, device="cuda") for _ in xs]
    routes = [(z.topk(shape.topk).indices, z.topk(shape.topk).values.softmax(-1)) for z in logits]

    def call(m, x, i, by_routes):
        return m(x, routes=routes[i]) if by_routes else m(x, router_logits=logits[i])

    for by_routes in (False, True):
        ref = []
        for i, (m, x, dy) in enumerate(zip(mods[False], xs, dys)):  # alone: resident
            m.zero_grad(set_to_none=True)
            xg = x.detach().requires_grad_()
            call(m, xg, i, by_routes).backward(dy)
            ref.append([xg.grad] + [p.grad for p in m.parameters()])
        leaves = [x.detach().requires_grad_() for x in xs]
        for m in mods[True]:
            m.zero_grad(set_to_none=True)
        ys = [call(m, xg, i, by_routes) for i, (m, xg) in enumerate(zip(mods[True], leaves))]
        rt = ops_kernels(mods[True][0]).runtime()
        replayed = rt.stats["replayed"]
        torch.autograd.backward(ys, dys)
        assert rt.stats["replayed"] == replayed
        for i, (m, xg) in enumerate(zip(mods[True], leaves)):
            got = [xg.grad] + [p.grad for p in m.parameters()]
            assert len(got) == len(ref[i]) == 5
            for j, (g, h) in enumerate(zip(got, ref[i])):
                assert torch.equal(g, h), f"layer {i}, gradient {j}, by routes {by_routes}"


def ops_kernels(module):
    from mokgen.pytorch import ops
    return ops.kernels_of(module._layer).layer()


def test_backward_no_shared_expert():
    run_backward(mokgen.MoEShape(16, 512, 256, 2, shared_experts=0), 2, 300)


def test_backward_bitwise_repeatable_and_stale_ring():
    shape = mokgen.shapes.get("gpu-small")
    layer, inputs, dys, first = run_backward(shape, 4, 700, minibatch=256, macrobatch=512)
    again = grads_of(layer, inputs, dys)
    for k, v in first.items():
        for a, b in zip(v if isinstance(v, list) else [v], again[k] if isinstance(v, list) else [again[k]]):
            assert torch.equal(a, b), f"{k}: not bitwise identical over calls"
    # another forward between this forward and its backward: the ring no longer holds it,
    # nor the shared expert's activations; the backward re-schedules, replays everything and
    # recomputes the shared expert's gate/up, with the same gradients
    leaves = {k: [t.detach().clone().requires_grad_() for t in inputs[k]] for k in NAMES}
    shared = {k: inputs[k].detach().clone().requires_grad_() for k in ("shared_w1", "shared_w2")}
    ys = layer(**leaves, **shared)
    other = make_inputs(shape, 4, 700)
    with torch.no_grad():
        layer(**other)
    replayed = layer.runtime().stats["replayed"]
    torch.autograd.backward(ys, dys)
    assert layer.runtime().stats["replayed"] == replayed + 1
    for k in NAMES:
        for r, t in enumerate(leaves[k]):
            assert torch.equal(t.grad, first[k][r]), f"{k}[{r}]: stale-ring backward differs"
    for k, t in shared.items():
        assert torch.equal(t.grad, first[k]), f"{k}: the recomputed shared expert differs"


# One rank in bf16, asked to (dispatch="gather"), gathers x and dy rows in its GEMMs
# (sm_partition.gathers) instead of copying them into rings: the same tiles over the same rows in the same K order, so outputs and
# every gradient equal the pulled path's bit for bit. Edge widths (D 2880: a K tail in the
# gathered slices, edge columns in the weight gradients'), a shared expert, a stale ring (the
# backward then replays its gate/up from gathered x). The forward gathering alone
# (reverse_combine="pull": the backward's comm CTAs pull x beside dy, FwdConsts XPULL), its
# ring resident: the same bits again. Lane 0 of each producer warp alone polling the empty
# stages (the gather_one_waiter profile, results right): the same bits.
@pytest.mark.parametrize("shape", [mokgen.shapes.get("gpu-small"),
                                   mokgen.MoEShape(12, 2880, 704, 3, shared_experts=0),
                                   mokgen.MoEShape(60, 512, 352, 4, shared_experts=1,
                                                   shared_intermediate=256)])
def test_gathered_rows_equal_the_pulled_ones_bitwise(shape):
    tokens = 700
    inputs = make_inputs(shape, 1, tokens)
    dys = [torch.randn_like(x) for x in inputs["x"]]
    got = {}
    ways = {"gather": dict(dispatch="gather"),  # reverse_combine follows
            "fwd-gather": dict(dispatch="gather", reverse_combine="pull"),
            "one-waiter": dict(dispatch="gather", profile=("gather_one_waiter",)),
            "pull": dict(dispatch="pull")}
    for way, force in ways.items():
        layer = mokgen.compile(shape, ep=1, tokens_per_rank=tokens, virtual=True, **force)
        p = layer.plan
        assert (p.dispatch, p.reverse_combine) == {"fwd-gather": ("gather", "pull"),
                                                   "pull": ("pull", "pull")}.get(
            way, ("gather", "gather"))
        assert (p.comm_sms_fwd == 0) == (way != "pull")
        # copied rows: dx rows in the dy ring (passes/dx_rows.py), bitwise the pushed ones
        assert p.reverse_dispatch == ("ring" if way in ("pull", "fwd-gather") else "push")
        assert (p.comm_sms_bwd == 0) == (way in ("gather", "one-waiter"))
        layer.runtime().poison()
        layer.backward_runtime().poison()
        leaves = {k: [t.detach().clone().requires_grad_() for t in inputs[k]] for k in NAMES}
        shared = {k: None if inputs[k] is None else inputs[k].detach().clone().requires_grad_()
                  for k in ("shared_w1", "shared_w2")}
        ys = layer(**leaves, **shared)
        if way == "gather":  # a forward in between: the backward replays from gathered x
            with torch.no_grad():
                layer(**make_inputs(shape, 1, tokens))
        torch.autograd.backward(ys, dys)
        torch.cuda.synchronize()
        layer.synchronize()
        got[way] = dict(y=[y.detach() for y in ys], **{k: [t.grad for t in v] for k, v in leaves.items()},
                        **{k: None if t is None else t.grad for k, t in shared.items()})
    check({k: v for k, v in got["gather"].items() if k != "y"},
          reference_grads(shape, inputs, dys))
    for way in ("gather", "fwd-gather", "one-waiter"):
        for k, v in got[way].items():
            for a, b in zip(*(x if isinstance(x, list) else [x] for x in (v, got["pull"][k]))):
                if a is None and b is None:  # no shared expert
                    continue
                assert a is not None and torch.isfinite(a).all(), f"{way} {k}: not finite"
                assert torch.equal(a, b), f"{way} {k}: gathered rows differ from pulled ones"


@pytest.mark.parametrize("name", ["kimi-k2.7", "qwen3.5-397b-a17b"])
def test_backward_preset_dims(name):
    # the preset's hidden, intermediate and top-k with 16 experts over 2 ranks: all 8+ ranks'
    # experts of the real preset (34 GB for kimi in bf16) and their fp32 reference don't fit
    p = mokgen.shapes.get(name)
    shape = mokgen.MoEShape(16, p.hidden, p.intermediate, p.topk)
    run_backward(shape, 2, 256)


def gemm_test_module(tmp_path):
    """gemm_test.cu (the engine's standalone kernels) built and loaded; its shared memory."""
    from mokgen.runtime import cuda as mc

    cubin = str(tmp_path / "gemm_test.cubin")
    subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17",
                    "-cubin", "-I", os.path.join(ROOT, "mokgen/runtime/include"),
                    os.path.join(ROOT, "tests/cuda/gemm_test.cu"),
                    "-o", cubin], check=True, capture_output=True)
    return mc.load_module(cubin), smem_bytes(GemmConfig(128, 256, 4))  # its CoopCfg


@pytest.mark.parametrize("n", [512, 384])
@pytest.mark.parametrize("trans", [1, 2])
def test_gemm_engine_transposed_operands(tmp_path, trans, n):
    """The engine's MN-major paths alone: C = A B^T with B given as [K, N] (trans 1) or A as
    [K, M] and B as [K, N] (trans 2). N = 384: the last 256-wide tile is an edge tile of 128
    columns, run narrow (N = 128, two of its four B boxes not loaded: gemm_epilogue.cuh
    half_bit), as in the backward for widths that are odd multiples of 128."""
    from mokgen.runtime import cuda as mc

    mod, smem = gemm_test_module(tmp_path)
    f = mod.function("gemm_plain_t", smem)
    M, N, K = 384, n, 320
    A = torch.randn(M, K, device="cuda").bfloat16()
    B = torch.randn(N, K, device="cuda").bfloat16()
    C = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    Bt = B.T.contiguous()  # [K, N]
    tb = mc.make_tensor_map_2d(Bt, K, N, N * 2, 64, 64)
    if trans == 2:
        At = A.T.contiguous()
        ta = mc.make_tensor_map_2d(At, K, M, M * 2, 64, 64)
    else:
        ta = mc.make_tensor_map_2d(A, M, K, K * 2, 128, 64)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    mc.launch(f, 8, 384, smem, None, [ta, tb, C, M, N, K, N, counter, trans])
    torch.cuda.synchronize()
    ref = A.float() @ B.float().T
    assert rel_error(C, ref) <= 1e-2


# gemm_test.cu's whole-task ping-pong kernels and their shared memory (PtCfg<TN, ST>::
# SMEM_BYTES, which gemm_test.cu asserts)
PT_KERNELS = {kind: (name, smem_bytes(GemmConfig(128, tn, st))) for kind, name, tn, st in (
    ("pt0", "gemm_plain_pt", 128, 6), ("pt2", "gemm_plain_t2_pt", 128, 6),
    ("pt4_0", "gemm_plain_pt4", 128, 4), ("pt4_2", "gemm_plain_t2_pt4", 128, 4),
    ("pt192_0", "gemm_plain_pt192", 192, 5), ("pt192_2", "gemm_plain_t2_pt192", 192, 5))}


@pytest.mark.parametrize("kind", ["pt0", "pt2", "pt4_0", "pt4_2", "pt192_0", "pt192_2", "pair",
                                  "mc"])
def test_gemm_engine_experiments_equal_the_cooperative_tiles(tmp_path, kind):
    """The experiments of gemm_test.cu: whole-task ping-pong
    (128 x 128 and 128 x 192 tasks, K-major or both operands MN-major) and cluster pairs
    with and without B multicast give the cooperative tiles' output bit for bit, on fresh
    inputs into a NaN-poisoned output, with the CTAs taking several tasks each (odd and even
    counts)."""
    from mokgen.runtime import cuda as mc

    mod, smem = gemm_test_module(tmp_path)
    M, N, K = 512, 768, 320
    A = torch.randn(M, K, device="cuda").bfloat16()
    B = torch.randn(N, K, device="cuda").bfloat16()
    ref = A.float() @ B.float().T
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    outs = []
    for exp in (False, True):
        C = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        if kind in ("pt2", "pt4_2", "pt192_2"):
            At, Bt = A.T.contiguous(), B.T.contiguous()
            ta = mc.make_tensor_map_2d(At, K, M, M * 2, 64, 64)
            tb = mc.make_tensor_map_2d(Bt, K, N, N * 2, 64, 64)
            if exp:
                name, pt_smem = PT_KERNELS[kind]
                mc.launch(mod.function(name, pt_smem), 5, 384, pt_smem, None,
                          [ta, tb, C, M, N, K])
            else:
                counter.zero_()
                mc.launch(mod.function("gemm_plain_t", smem), 5, 384, smem, None,
                          [ta, tb, C, M, N, K, N, counter, 2])
        else:
            ta = mc.make_tensor_map_2d(A, M, K, K * 2, 128, 64)
            box = {"pt0": 128, "pt4_0": 128, "pt192_0": 192, "mc": 128}.get(kind, 256) \
                if exp else 256
            tb = mc.make_tensor_map_2d(B, N, K, K * 2, box, 64)
            if not exp:
                counter.zero_()
                mc.launch(mod.function("gemm_plain", smem), 5, 384, smem, None,
                          [ta, tb, C, M, N, K, N, counter])
            elif kind in PT_KERNELS:
                name, pt_smem = PT_KERNELS[kind]
                mc.launch(mod.function(name, pt_smem), 5, 384, pt_smem, None,
                          [ta, tb, C, M, N, K])
            else:  # 2 clusters of 2 on a static pair schedule
                name = "gemm_plain_mc" if kind == "mc" else "gemm_plain_pair"
                mc.launch(mod.function(name, smem), 4, 384, smem, None, [ta, tb, C, M, N, K])
        torch.cuda.synchronize()
        outs.append(C)
    assert rel_error(outs[1], ref) <= 1e-2
    assert torch.equal(outs[0], outs[1])


def test_backward_without_host_sync_and_steady_memory():
    """Forward + backward through autograd: no host synchronization (sync debug mode raises
    on one), and 200 training calls leave the allocated memory where it was."""
    shape = mokgen.shapes.get("gpu-small")
    layer, inputs, dys, first = run_backward(shape, 2, 500)
    grads_of(layer, inputs, dys)
    # earlier tests' layers (cycles) freed now, not by a collection inside the loop, where
    # their workspaces' release would read as this layer's memory moving
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(200):
            grads_of(layer, inputs, dys)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    layer.synchronize()
    assert torch.cuda.memory_allocated() == before
