"""Memory of a model (CPU): the workspace's size from the plan, the fp32 weight-gradient sums
only where the ring can wrap, the registry releasing layers with their modules."""
import copy
import gc
import json
import weakref

import pytest
import torch

import mokgen
from mokgen.compiler import codegen
from mokgen.pytorch import ops
from mokgen.compiler.lower import layer_spec
from mokgen.pytorch.api import format_memory, memory_report, stack_memory
from mokgen.cli import main as cli
from mokgen.compiler.plan import Plan
from mokgen.runtime.workspace import BackwardScratch, KeptActivations, live_workspaces, shared

QWEN3_30B = mokgen.MoEShape(128, 2048, 768, 8, shared_experts=0)


def test_wg_acc_only_where_an_expert_can_span_ring_passes():
    whole = mokgen.plan(QWEN3_30B, ep=1, tokens_per_rank=8192)
    assert whole.macrobatch >= whole.max_routed_rows  # ep = 1: the ring holds every row
    small = mokgen.plan(QWEN3_30B, ep=1, tokens_per_rank=8192, macrobatch=2 * whole.minibatch)
    meta = torch.device("meta")
    assert BackwardScratch(layer_spec(whole), meta).wg_acc is None
    acc = BackwardScratch(layer_spec(small), meta).wg_acc
    s = QWEN3_30B
    # fewer minibatches than experts: a sum per minibatch boundary, not per expert
    sp = layer_spec(small)
    assert sp.wg_by_minibatch and sp.wg_acc_slots == sp.max_minibatches - 1 < s.num_experts
    assert acc is not None and acc.numel() == sp.wg_acc_slots * 3 * s.intermediate * s.hidden
    a, b = memory_report(whole), memory_report(small)
    assert not a["wg_acc"] and b["wg_acc"]
    assert b["workspace"]["backward"] > acc.numel() * 4


def test_memory_report_sums_its_parts_and_the_saved_bytes():
    p = mokgen.plan(QWEN3_30B, ep=1, tokens_per_rank=8192, keep_h=False)  # h in the ring
    r = memory_report(p)
    ws = r["workspace"]
    assert ws["total"] == ws["peer"] + ws["forward"] + ws["backward"]
    n, s = 8192, QWEN3_30B
    assert r["saved_per_layer"] == n * s.hidden * 2 + n * s.num_experts * 4 + n * s.topk * 8
    # the ring dominates: x, a and the gate/up pre-activations of every ring row
    assert ws["forward"] >= p.macrobatch * (s.hidden + 3 * s.intermediate) * 2
    # gathered rows (dispatch="gather"): no x or dy ring, no comm CTAs
    g = mokgen.plan(QWEN3_30B, ep=1, tokens_per_rank=8192, dispatch="gather")
    wg = memory_report(g)["workspace"]
    assert g.macrobatch * 3 * s.intermediate * 2 <= wg["forward"] < \
        g.macrobatch * (s.hidden + 3 * s.intermediate) * 2
    # its backward has no dy ring (with dx rows in it, the copied plans' is in peer)
    pp = memory_report(mokgen.plan(QWEN3_30B, ep=1, tokens_per_rank=8192,
                                   reverse_dispatch="push"))["workspace"]
    assert wg["backward"] < pp["backward"] - p.macrobatch * s.hidden * 2 // 2


@pytest.mark.parametrize("dtype,scale_bytes", [("bf16", 0), ("fp8", 4 / (128 * 128)),
                                               ("mxfp8", 4 / 32)])
def test_quantized_weights_per_layer_are_the_padded_weights_forward_layout(dtype, scale_bytes):
    # widths off the 128 blocks: W1's gate and up halves and W2 pad per expert (pad_weight)
    s = mokgen.MoEShape(16, 320, 208, 2, shared_experts=0)
    p = mokgen.plan(s, ep=2, tokens_per_rank=512, dtype=dtype)
    r = memory_report(p)
    elems = 0 if dtype == "bf16" else 8 * 3 * 384 * 256  # 8 local experts, padded D and I
    # the forward's layout, held; the backward's transposed copy, as many bytes, made and
    # freed by each backward call: one layer's at a time
    assert r["quantized_weights_per_layer"] == r["quantized_transposed"] == \
        elems * (1 + scale_bytes)
    assert ("quantized weights held per layer" in format_memory(r)) == (dtype != "bf16")
    stack = [stack_memory(p, n) for n in (1, 3)]
    assert [m["fp8_weights"] for m in stack] == \
        [elems and r["quantized_weights_per_layer"] * n for n in (1, 3)]
    bf16 = stack_memory(mokgen.plan(s, ep=2, tokens_per_rank=512), 1)["transient"]
    assert stack[0]["transient"] - bf16 == r["quantized_transposed"]


def test_dx_rows_in_the_dy_ring_put_it_in_the_combine_rows():
    """reverse_dispatch "ring" (one rank, bf16, a ring holding every minibatch: the default
    there, passes/dx_rows.py) keeps one buffer for the dy ring and the T k combine rows, of
    the larger's rows, plus each route's ring row and a count per expert; ep > 1, fp8, a
    smaller ring and gathered rows keep pushing dx rows."""
    n, s = 8192, QWEN3_30B
    p = mokgen.plan(s, ep=1, tokens_per_rank=n)
    q = mokgen.plan(s, ep=1, tokens_per_rank=n, reverse_dispatch="push")
    assert (p.reverse_dispatch, q.reverse_dispatch) == ("ring", "push")
    assert p.macrobatch == q.macrobatch
    a, b = memory_report(p)["workspace"], memory_report(q)["workspace"]
    M, D, NK = p.macrobatch, s.hidden, n * s.topk
    assert b["total"] - a["total"] == M * D * 2 + NK * D * 2 - max(M, NK) * D * 2 - NK * 4 \
        - s.num_experts * 4
    assert b["total"] - a["total"] > 250 * 2**20  # Qwen3-30B-A3B, T 8192: the combine rows
    assert mokgen.plan(s, ep=8, tokens_per_rank=n).reverse_dispatch == "push"
    assert mokgen.plan(s, ep=1, tokens_per_rank=n, dtype="fp8").reverse_dispatch == "push"
    small = mokgen.plan(s, ep=1, tokens_per_rank=n, ring_budget_bytes=300 << 20)
    assert small.macrobatch < small.max_routed_rows and small.reverse_dispatch == "push"
    g = mokgen.plan(s, ep=1, tokens_per_rank=n, dispatch="gather")
    assert g.reverse_dispatch == "push"  # no dy ring


def test_x_window_shrinks_the_x_ring_where_the_forward_gathers():
    """A forward that gathers x (dispatch "gather", reverse_combine "pull"): the backward's comm
    CTAs copy x, and its x ring is a window of the fewest slots that an expert's rows (at most
    one a token) plus 2 minibatches need (passes/x_window.py); the workspace is smaller by the
    rest of the ring's x rows. Elsewhere (copied or fully gathered rows, ep > 1, fp8) and
    forced to the ring's slots, none; a forced value outside its range is refused."""
    n, s = 8192, QWEN3_30B
    fwd_gather = dict(dispatch="gather", reverse_combine="pull")
    p = mokgen.plan(s, ep=1, tokens_per_rank=n, **fwd_gather)
    b, D = p.minibatch, s.hidden
    assert p.x_slots == 3 + (n - 2) // b < p.ring_slots and p.reverse_dispatch == "ring"
    assert layer_spec(p).x_rows == p.x_slots * b
    whole = mokgen.plan(s, ep=1, tokens_per_rank=n, x_slots=p.ring_slots, **fwd_gather)
    assert layer_spec(whole).x_slots == 0 and whole.macrobatch == p.macrobatch
    assert layer_spec(mokgen.plan(s, ep=1, tokens_per_rank=n, x_slots=10**6, **fwd_gather)) \
        == layer_spec(whole)  # the ring's slots or more: no window
    a, w = memory_report(p)["workspace"], memory_report(whole)["workspace"]
    # the x rows less, and a count per expert (wg1_done) more
    assert w["total"] - a["total"] == (p.ring_slots - p.x_slots) * b * D * 2 - s.num_experts * 4
    assert w["total"] - a["total"] > 250 * 2**20  # Qwen3-30B-A3B, T 8192
    for kw in ({}, dict(dispatch="gather"), dict(dtype="fp8")):
        assert mokgen.plan(s, ep=1, tokens_per_rank=n, **kw).x_slots is None, kw
    assert mokgen.plan(s, ep=8, tokens_per_rank=2048).x_slots is None
    with pytest.raises(ValueError, match=r"x_slots must be >= "):
        mokgen.plan(s, ep=1, tokens_per_rank=n, x_slots=p.x_slots - 1, **fwd_gather)
    with pytest.raises(ValueError, match="x_slots needs ep == 1, dtype bf16, dispatch='gather'"):
        mokgen.plan(s, ep=1, tokens_per_rank=n, x_slots=8)
    with pytest.raises(ValueError, match="x_slots must be an int >= 1"):
        mokgen.plan(s, ep=1, tokens_per_rank=n, x_slots=0, **fwd_gather)
    # the window reaches the kernel (FwdConsts XSLOTS), the whole ring renders as before
    bwd = [k.source for k in codegen.emit(p, ("bwd",))] + [k.source for k in
                                                         codegen.emit(whole, ("bwd",))]
    assert f"/*XSLOTS*/ {p.x_slots}>" in bwd[0] and "/*XSLOTS*/" not in bwd[1]


def test_keep_h_moves_h_from_the_workspace_to_each_call_and_pulls_x():
    """keep_h (one rank, bf16, a ring holding every minibatch): the workspace has no ring_h,
    each differentiable call keeps its own (saved_per_layer grows by it, and by the shared
    expert's activations where there is one); the backward kernel pulls x (FwdConsts XPULL)
    and the forward's source is the one that leaves h in the ring; the key of a plan without
    it (ep > 1, fp8) is unchanged. It is the default where its rules hold (passes/keep_h.py);
    forced elsewhere, refused, naming the rule."""
    n, s = 8192, QWEN3_30B
    p = mokgen.plan(s, ep=1, tokens_per_rank=n, keep_h=False)
    k = mokgen.plan(s, ep=1, tokens_per_rank=n)
    assert (k.macrobatch, k.minibatch) == (p.macrobatch, p.minibatch) and k.keep_h
    a, b = memory_report(p), memory_report(k)
    ring_h = p.macrobatch * 2 * s.intermediate * 2
    assert a["workspace"]["total"] - b["workspace"]["total"] == ring_h
    # a call keeps the rows its n tokens can fill (KeptActivations.kept_rows): n k routes,
    # each of the E experts' regions padded to the 128-row tile, within the ring
    def kept_rows(n_tokens, shape, macrobatch):
        return min(macrobatch, -(-(n_tokens * shape.topk + shape.num_experts * 127) // 128) * 128)

    rows = kept_rows(n, s, k.macrobatch)
    assert rows == 8192 * 8 + 128 * 127 < k.macrobatch  # the ring rounds up to minibatches
    assert b["saved_per_layer"] - a["saved_per_layer"] == rows * 2 * s.intermediate * 2
    spec = layer_spec(k)
    for m in (1, 100, 2048, 8191, 8192):
        got = KeptActivations.shapes(spec, m)
        assert got == [(kept_rows(m, s, k.macrobatch), 2 * s.intermediate)], (m, got)
    sh = mokgen.MoEShape(64, 2048, 1408, 6, shared_experts=1, shared_intermediate=2816)
    r0 = memory_report(mokgen.plan(sh, ep=1, tokens_per_rank=4096, keep_h=False))
    r1 = memory_report(q := mokgen.plan(sh, ep=1, tokens_per_rank=4096))
    assert r1["saved_per_layer"] - r0["saved_per_layer"] == \
        (kept_rows(4096, sh, q.macrobatch) * 2 * sh.intermediate + 4096 * 3 * 2816) * 2
    def units(plan):  # the plan key (named in the sources) taken out
        return {u.name.split("_")[0]: u.source.replace(plan.key(), "<key>")
                for u in codegen.emit(plan, ("fwd", "bwd"))}
    src, base = units(k), units(p)
    assert "/*XPULL*/ true" in src["bwd"] and "/*XPULL*/ false" in base["bwd"]
    assert src["fwd"] == base["fwd"]
    assert "keep_h" not in json.loads(p.to_json()) and json.loads(k.to_json())["keep_h"] is True
    assert "keep_h" not in mokgen.plan(s, ep=8, tokens_per_rank=2048).to_json()
    assert Plan.from_json(k.to_json()) == k
    with pytest.raises(ValueError, match="keep_h needs ep == 1 and dtype bf16"):
        mokgen.plan(s, ep=1, tokens_per_rank=n, keep_h=True, dtype="fp8")
    with pytest.raises(ValueError, match="keep_h needs ep == 1 and dtype bf16"):
        mokgen.plan(s, ep=8, tokens_per_rank=2048, keep_h=True)
    with pytest.raises(ValueError, match="keep_h needs a ring that holds every minibatch"):
        mokgen.plan(s, ep=1, tokens_per_rank=n, keep_h=True, ring_budget_bytes=300 << 20)
    with pytest.raises(ValueError, match="keep_h must be True or False"):
        mokgen.plan(s, ep=1, tokens_per_rank=n, keep_h=1)


def test_cli_plan_prints_the_memory(capsys):
    assert cli(["plan", "--shape", "kimi-k2.7", "--ep", "64"]) == 0
    assert "memory per rank: workspace" in capsys.readouterr().out
    assert cli(["plan", "--shape", "kimi-k2.7", "--ep", "64", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["memory"]["workspace"]["total"] > 0 and d["macrobatch"] > 0
    # keep_h: the default at one rank in bf16; --no-keep-h forces h into the shared ring
    base = ["plan", "--shape", "qwen3-30b-a3b", "--ep", "1", "--tokens", "8192", "--json"]
    got = {}
    for flag in ([], ["--keep-h"], ["--no-keep-h"]):
        assert cli(base + flag) == 0
        d = json.loads(capsys.readouterr().out)
        got[tuple(flag)] = (d.get("keep_h", False), d["memory"]["saved_per_layer"])
    assert got[()] == got[("--keep-h",)] and got[()][0] and not got[("--no-keep-h",)][0]
    assert got[()][1] > got[("--no-keep-h",)][1]


def test_modules_release_their_registration_and_copies_get_their_own():
    shape = mokgen.shapes.get("small")
    layer = mokgen.MoE(shape, tokens_per_rank=64)
    handle = layer._layer
    assert handle in ops._LAYERS
    twin = copy.deepcopy(layer)
    assert twin._layer != handle and twin._layer in ops._LAYERS
    del layer
    gc.collect()
    assert handle not in ops._LAYERS
    x = torch.randn(10, shape.hidden)
    twin(x)  # still usable (CPU: the reference path)


def test_pool_shares_while_alive_and_forgets_after():
    class Thing:
        pass

    made = []

    def make():
        made.append(Thing())
        return made[-1]

    before = live_workspaces()
    a = shared(("test-key",), make)
    b = shared(("test-key",), make)
    assert a is b and len(made) == 1 and live_workspaces() == before + 1
    del a, b, made[:]
    gc.collect()
    assert live_workspaces() == before
    c = shared(("test-key",), make)
    assert len(made) == 1 and c is made[0]  # a fresh one


def test_pool_survives_the_collector_inside_make():
    """A pooled object that only the garbage collector frees (a reference cycle) dies while
    shared() builds another (make() allocates, an allocation runs the collector): its weakref
    callback must not deadlock on the pool's lock (it did, on the GPU, in test_gpu_widths)."""
    import threading

    class Cyclic:
        def __init__(self):
            self.me = self  # freed by the collector only

    shared(("cycle", 1), Cyclic)  # nobody holds it: garbage, not yet collected

    def make():
        gc.collect()  # what an allocation may do: runs the dead object's callback here
        return Cyclic()

    done = []
    t = threading.Thread(target=lambda: done.append(shared(("cycle", 2), make)), daemon=True)
    gc.disable()  # the cycle must survive until make() collects it
    try:
        t.start()
        t.join(timeout=10)
    finally:
        gc.enable()
    assert done, "shared() deadlocked in the pool's weakref callback"


def test_rel_error_in_pieces_matches_the_plain_formula():
    """workloads.rel_error sums in pieces (no fp32 copy of a model's gradients): same value
    as the one-shot formula, whatever the piece size; broadcasting still works."""
    import torch

    from mokgen.harness.workloads import rel_error
    g = torch.Generator().manual_seed(0)
    a = torch.randn(300, 77, generator=g).bfloat16()
    b = (a.float() + 1e-2 * torch.randn(300, 77, generator=g)).bfloat16()
    plain = ((a.float() - b.float()).norm() / b.float().norm()).item()
    for chunk in (1, 1000, 77 * 300, 1 << 26):
        assert abs(rel_error(a, b, chunk=chunk) - plain) <= 1e-5 * plain  # fp32 sums
    assert rel_error(a, a) == 0.0
    assert abs(rel_error(a.float(), a.float()[:1]) - ((a.float() - a.float()[:1]).norm()
                                                       / a.float()[:1].norm()).item()) < 1e-6


class _KeepingLayer:
    """A keep_h layer's forward_raw / backward_raw (mokgen.pytorch.api.CompiledMoE's) in torch on the
    CPU: y = 2 x, and each forward keeps a fresh h = x + 1 (KeptActivations, one hosted
    rank), which the backward records."""

    def __init__(self):
        from mokgen.runtime.workspace import KeptActivations
        self.kept_of, self.made, self.seen = KeptActivations.of, [], []

    def forward_raw(self, xs, zs, w1s, w2s, sw1, sw2, given=None, save=False):
        h = xs[0].detach() + 1
        self.made.append(weakref.ref(h))
        return [2 * xs[0]], given, len(self.made), [self.kept_of([h])]

    def backward_raw(self, dys, xs, w1s, w2s, sw1, sw2, routes, generation, kept=None):
        self.seen.append(kept[0].ring_h)
        return ([2 * dys[0]], [torch.zeros_like(routes[0][1])], [torch.zeros_like(w1s[0])],
                [torch.zeros_like(w2s[0])], None, None)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_compiled_layer_saves_its_kept_activations_as_saved_tensors(checkpointed):
    """mokgen.compile's autograd Function saves a keep_h call's kept h as a saved tensor, so
    activation checkpointing frees it with the forward and the backward gets the re-run
    forward's, as the custom ops of mokgen.MoE do (ops.py): as an attribute of ctx it stayed
    for every layer until its backward, checkpointed or not."""
    from torch.utils.checkpoint import checkpoint

    from mokgen.pytorch.api import _MoEFunction

    layer = _KeepingLayer()
    x = torch.randn(6, 8, requires_grad=True)
    experts, weights = torch.zeros(6, 2, dtype=torch.int64), torch.rand(6, 2)
    w1, w2 = torch.randn(2, 4, 8), torch.randn(2, 8, 2)

    def f(x):
        return _MoEFunction.apply(layer, [experts], 1, x, weights, w1, w2, None, None)[0]

    y = checkpoint(f, x, use_reentrant=False) if checkpointed else f(x)
    gc.collect()
    assert (layer.made[0]() is None) == checkpointed  # freed with a checkpointed forward
    y.backward(torch.ones_like(y))
    assert len(layer.made) == 1 + checkpointed  # checkpointing re-ran the forward
    assert layer.seen[0] is layer.made[-1]() and torch.equal(layer.seen[0], x.detach() + 1)
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
