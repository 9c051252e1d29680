"""The `trace` profile on the GPU (marked gpu): a traced build's outputs and gradients are
bitwise those of the plain build, and its buffer holds a record per task with its clocks in
order."""

import pytest
import torch

import mokgen
from mokgen.runtime import abi
from mokgen.harness.trace import traced as read_trace
from mokgen.harness.workloads import make_inputs
from test_gpu_backward import NAMES

pytestmark = pytest.mark.gpu
SHAPE = mokgen.MoEShape(16, 1024, 512, 4, shared_intermediate=512, name="trace-small")
TOKENS = 700


def _leaves(inputs):
    out = {k: [t.detach().clone().requires_grad_() for t in inputs[k]] for k in NAMES}
    out.update({k: inputs[k].detach().clone().requires_grad_()
                for k in ("shared_w1", "shared_w2")})
    return out


def _step(layer, inputs, dys, trace=None):
    """Forward and backward through autograd; trace(module, ctas, run) wraps each kernel's
    call when given. -> (outputs, gradients, forward records, backward records)."""
    leaves = _leaves(inputs)
    rt = layer.runtime()
    recs = {}
    if trace:
        box = {}
        recs["fwd"] = trace(rt.fwd_module, rt.fwd_ctas,
                            lambda: box.setdefault("ys", layer(**leaves)))
        ys = box["ys"]
        bwd = layer.backward_runtime()
        recs["bwd"] = trace(bwd.modules, bwd.ctas, lambda: torch.autograd.backward(ys, dys))
    else:
        ys = layer(**leaves)
        torch.autograd.backward(ys, dys)
    torch.cuda.synchronize()
    grads = {k: [t.grad for t in v] if isinstance(v, list) else v.grad
             for k, v in leaves.items()}
    return ys, grads, recs.get("fwd"), recs.get("bwd")


def _flat(x):
    return [t for v in x for t in (v if isinstance(v, list) else [v])]


def test_trace_build_is_bitwise_plain_and_records_every_task_in_order():
    plain = mokgen.compile(SHAPE, ep=1, tokens_per_rank=TOKENS, virtual=True)
    traced = mokgen.compile(SHAPE, ep=1, tokens_per_rank=TOKENS, virtual=True,
                            profile=("trace",))
    inputs = make_inputs(SHAPE, 1, TOKENS)
    dys = [torch.randn_like(x) for x in inputs["x"]]
    ys0, g0, _, _ = _step(plain, inputs, dys)
    ys1, g1, rf, rb = _step(traced, inputs, dys, trace=read_trace)
    for a, b in zip(_flat(ys0), _flat(ys1)):
        assert torch.equal(a, b), "a traced forward's output differs from the plain build's"
    for k in g0:
        for a, b in zip(_flat([g0[k]]), _flat([g1[k]])):
            assert torch.equal(a, b), f"a traced backward's {k} gradient differs"
    F = {k: i for i, k in enumerate(abi.TRACE_FIELDS)}
    order = ("kTrAsk", "kTrGot", "kTrPop", "kTrMain", "kTrEpi", "kTrDone")
    # the backward follows its own layer's forward, so it reads the shared expert's kept
    # pre-activations and runs no SGateUp (BwdSchedule::shared_kept)
    for recs, ops, want, absent in (
            (rf, abi.FWD_OPS, {"GateUp", "Down", "SharedGateUp", "SharedDown"}, set()),
            (rb, abi.BWD_OPS, {"Dgrad", "Dx", "Wgrad1", "Wgrad2", "SDgrad", "SDx", "SWgrad1",
                               "SWgrad2"}, {"SGateUp"})):
        rows = [r for cta in recs for r in cta if r[F["kTrGot"]] != 0]
        assert rows, "no records"
        for r in rows:  # every task the producer handed out was run to its signal, in order
            # the producer's ask and take, and the consumers' pop to signal, each in order;
            # with a scheduling thread (GemmCfg::SCHEDULER) the consumers may pop a task
            # before the producer records taking it (both read the channel entry the
            # scheduler published), so Got and Pop are ordered only against the mainloop
            for chain in (order[:2] + order[3:], order[2:]):
                clocks = [r[F[k]] for k in chain]
                assert r[F["kTrDone"]] != 0 and clocks == sorted(clocks), (chain, clocks)
        names = {v: k[1:] for k, v in ops.items()}  # kDgrad -> Dgrad
        kinds = {names.get(r[F["kTrOp"]] & abi.OPCODE_MASK, "?") for r in rows}
        assert want <= kinds and not absent & kinds, sorted(kinds)
        # the mainloops (pop to main) took clocks, and the tasks spread over time
        assert max(r[F["kTrMain"]] - r[F["kTrPop"]] for r in rows) > 0
        ns = [r[F["kTrGlobalNs"]] for r in rows]
        assert max(ns) > min(ns) > 0
