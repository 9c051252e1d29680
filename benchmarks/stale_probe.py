"""Which one-rank backward variants give a stale ring's backward (another forward between a
forward and its backward: everything replayed) other gradients than a fresh one's; prints,
per variant, the gradients that differ and their cosine to the reference."""
import sys
import torch
import mokgen
from mokgen.workloads import cosine, make_inputs, reference_grads

sys.path.insert(0, "tests")
NAMES = ("x", "router_logits", "w1", "w2")
V = {"pull": dict(dispatch="pull"), "pull-push": dict(dispatch="pull", reverse_dispatch="push"),
     "fwd-gather": dict(dispatch="gather", reverse_combine="pull"),
     "fwd-gather-whole": dict(dispatch="gather", reverse_combine="pull", x_slots=1 << 20),
     "fwd-gather-push": dict(dispatch="gather", reverse_combine="pull", x_slots=1 << 20,
                             reverse_dispatch="push")}


def grads(layer, inputs, dys, stale, shape, tokens):
    leaves = {k: [t.detach().clone().requires_grad_() for t in inputs[k]] for k in NAMES}
    shared = {k: None if inputs[k] is None else inputs[k].detach().clone().requires_grad_()
              for k in ("shared_w1", "shared_w2")}
    ys = layer(**leaves, **shared)
    if stale:
        with torch.no_grad():
            layer(**make_inputs(shape, 1, tokens))
    torch.autograd.backward(ys, dys)
    torch.cuda.synchronize()
    out = {k: v[0].grad for k, v in leaves.items()}
    out.update({k: t.grad for k, t in shared.items() if t is not None})
    return out


for shape, tokens, mb in [(mokgen.shapes.get("gpu-small"), 1500, 256),
                          (mokgen.shapes.get("gpu-small"), 1000, None)]:
    inputs = make_inputs(shape, 1, tokens)
    dys = [torch.randn_like(x) for x in inputs["x"]]
    ref = reference_grads(shape, inputs, dys)
    for v, kw in V.items():
        kw = dict(kw, **({"minibatch": mb} if mb else {}))
        layer = mokgen.compile(shape, ep=1, tokens_per_rank=tokens, virtual=True, **kw)
        p = layer.plan
        a = grads(layer, inputs, dys, False, shape, tokens)
        b = grads(layer, inputs, dys, True, shape, tokens)
        diff = [k for k in a if not torch.equal(a[k], b[k])]
        cos = {k: round(cosine(b[k], ref[k][0] if isinstance(ref[k], list) else ref[k]), 6)
               for k in diff}
        print(f"{tokens} mb {p.minibatch} {v:18s} rd={p.reverse_dispatch} x_slots={p.x_slots} "
              f"slots={p.ring_slots}: stale differs in {diff} cos {cos}", flush=True)
