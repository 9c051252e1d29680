"""Virtual ranks side by side on the GPU (marked gpu: skipped without one): a plan that
leaves room for every rank's megakernel at once (reserve_sms) runs the R ranks' forward and
backward kernels concurrently, each on its share of the SMs, as real ranks run. Against the
reference, and bitwise equal to the same decisions run one rank after another (only the CTA
count differs: every element is one tile's, in a fixed K order). Real ranks:
test_multigpu.py."""
import pytest
import torch

import mokgen
from mokgen.harness.workloads import (cosine, make_inputs, reference_grads,
                                      reference_outputs, rel_error, side_by_side_layers)

pytestmark = pytest.mark.gpu
EP = 2

# (tokens, pinned, skew) of every case: a ring that holds the whole call, one that wraps (the
# comm CTAs wait for freed slots; the backward replays), skewed routing (almost every token's
# first route on expert 0 of rank 0: "one-soft", whose router and other experts' gradients are
# not ~0 as "one"'s are), an odd token count, mxfp8
CASES = {"plain": (600, {}, None),
         "ring-wraps": (600, dict(minibatch=128, macrobatch=256), None),
         "skew-one": (600, dict(minibatch=128, macrobatch=256), "one-soft"),
         "odd-tokens": (555, {}, None),
         "mxfp8": (600, dict(minibatch=128, macrobatch=256, dtype="mxfp8"), None)}


def grads_poisoned(layer, inputs, dys):
    """y and every input's gradient through autograd, from fresh leaves, every output and
    scratch buffer of both megakernels poisoned first (an element a kernel forgets to write
    shows as NaN): (ys, {name: [per rank]})."""
    layer.runtime().poison()
    layer.backward_runtime().poison()
    leaves = {k: [t.detach().clone().requires_grad_() for t in v] if isinstance(v, list)
              else v.detach().clone().requires_grad_() for k, v in inputs.items()
              if v is not None}
    ys = layer(**leaves)
    torch.autograd.backward(ys, dys)
    torch.cuda.synchronize()
    layer.runtime().check()
    return ys, {k: [t.grad for t in v] if isinstance(v, list) else [v.grad]
                for k, v in leaves.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_side_by_side_matches_the_reference_and_one_after_another_bitwise(case):
    shape = mokgen.shapes.get("gpu-small")
    tokens, pinned, skew = CASES[case]
    fp8 = pinned.get("dtype")
    kws = side_by_side_layers(shape, EP, tokens, **pinned)
    # both layers planned before any CUDA tensor: benchmarks/prebuild.py collect (on a CPU)
    # records both plans (the first compile ends the test there)
    for kw in kws.values():
        mokgen.plan(shape, **kw)
    layers = {how: mokgen.compile(shape, virtual=True, **kw) for how, kw in kws.items()}
    inputs = make_inputs(shape, EP, tokens, skew=skew)
    dys = [torch.randn_like(x) for x in inputs["x"]]
    ref = reference_grads(shape, inputs, dys, fp8=fp8)
    ref_ys = reference_outputs(shape, inputs, fp8=fp8)
    cos_min, rel_max, rel_y = (0.996, 6e-2, 6e-2) if fp8 else (0.9999, 2e-2, 1e-2)
    got = {}
    for how, layer in layers.items():
        rt = layer.runtime()
        assert rt.side_by_side_ranks == (how == "side by side")
        ys, g = grads_poisoned(layer, inputs, dys)
        assert layer.backward_runtime().side_by_side == (how == "side by side")
        bad = [f"y[{r}]: rel {rel_error(y, w):.3e}" for r, (y, w) in enumerate(zip(ys, ref_ys))
               if not rel_error(y, w) <= rel_y]
        for k in ("x", "router_logits", "w1", "w2", "shared_w1", "shared_w2"):
            if k not in g or ref[k] is None:
                continue
            want = ref[k] if isinstance(ref[k], list) else [ref[k]]
            mine = g[k] if isinstance(ref[k], list) else [sum(t.float() for t in g[k])]
            for r, (a, w) in enumerate(zip(mine, want)):
                if a is None or not torch.isfinite(a).all():
                    bad.append(f"d{k}[{r}]: missing or not finite (unwritten rows?)")
                    continue
                c, e = cosine(a, w), rel_error(a, w)
                if not (c >= cos_min and e <= rel_max):
                    bad.append(f"d{k}[{r}]: cosine {c:.6f} rel {e:.3e}")
        assert not bad, f"{how}: " + "; ".join(bad)
        again_ys, again = grads_poisoned(layer, inputs, dys)
        assert all(torch.equal(a, b) for a, b in zip(ys, again_ys)), f"{how}: y repeat differs"
        for k in g:
            for a, b in zip(g[k], again[k]):
                assert torch.equal(a, b), f"{how}: d{k} differs on a repeat"
        got[how] = (ys, g)
        layer.synchronize()
    (ys0, g0), (ys1, g1) = got["one after another"], got["side by side"]
    assert all(torch.equal(a, b) for a, b in zip(ys0, ys1)), "y differs bitwise"
    for k in g0:
        for r, (a, b) in enumerate(zip(g0[k], g1[k])):
            assert torch.equal(a, b), f"rank {r}: d{k} differs bitwise"
