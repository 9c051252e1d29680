"""Inputs for checks and benchmarks: every implementation gets the same tensors.

Random normal activations and logits (the paper's protocol); weights scaled by 1/sqrt(fan-in)
so outputs stay O(1) in bf16. Routing skews for the odd cases: "one" sends every token's
first route to global expert 0 ("one-soft": almost every token, with a
logit margin small enough that the other routes' weights and the router gradient stay
meaningful); "sparse" leaves every other local expert without tokens."""
from __future__ import annotations

import torch

from mokgen import reference
from mokgen.shapes import MoEShape


def make_inputs(shape: MoEShape, ep: int, tokens: int, device="cuda", seed=None,
                skew: str | None = None, dtype=torch.bfloat16) -> dict:
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(0, 2**62, (1,)).item()) if seed is None else seed)
    E, D, I, L = shape.num_experts, shape.hidden, shape.intermediate, shape.num_experts // ep
    rn = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    xs = [rn(tokens, D).to(dtype) for _ in range(ep)]
    zs = [rn(tokens, E) for _ in range(ep)]
    if skew == "one":
        for z in zs:
            z[:, 0] += 100.0
    elif skew == "one-soft":  # the same routing with weights whose gradients are not ~0
        for z in zs:
            z[:, 0] += 8.0
    elif skew == "sparse":
        for z in zs:
            z.view(tokens, E // 2, 2)[..., 1] -= 100.0  # odd experts never picked
    w1s = [(rn(L, 2 * I, D) / D**0.5).to(dtype) for _ in range(ep)]
    w2s = [(rn(L, D, I) / I**0.5).to(dtype) for _ in range(ep)]
    sw1 = sw2 = None
    if shape.shared_experts:
        sw1 = (rn(2 * shape.shared_dim, D) / D**0.5).to(dtype)
        sw2 = (rn(D, shape.shared_dim) / shape.shared_dim**0.5).to(dtype)
    return dict(x=xs, router_logits=zs, w1=w1s, w2=w2s, shared_w1=sw1, shared_w2=sw2)


def reference_outputs(shape: MoEShape, inputs: dict, fp8: str | None = None) -> list:
    """fp32 reference of every rank's output (EP-emulated, Algorithm-1 routing); `fp8`:
    the routed experts' operands quantized as the fp8 kernels quantize them."""
    return reference.moe_forward_ep(inputs["x"], inputs["router_logits"], inputs["w1"],
                                    inputs["w2"], inputs["shared_w1"], inputs["shared_w2"],
                                    shape.topk, compute_dtype=torch.float32, fp8=fp8)


def rel_error(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 26) -> float:
    """||a - b|| / ||b||, in fp32 pieces of `chunk` elements (summed in fp64), so comparing
    a large model's expert gradients (DeepSeek-V3: 7.5 G elements per layer at ep = 1) needs
    no fp32 copy of them."""
    if a.shape != b.shape:  # broadcasting callers: small tensors, the plain formula
        return ((a.float() - b.float()).norm() / b.float().norm()).item()
    a, b = a.reshape(-1), b.reshape(-1)
    num = den = torch.zeros((), dtype=torch.float64, device=a.device)
    for i in range(0, a.numel(), chunk):
        x, y = a[i:i + chunk].float(), b[i:i + chunk].float()
        num = num + (x - y).square().sum().double()
        den = den + y.square().sum().double()
    return (num.sqrt() / den.sqrt()).item()


def reference_grads(shape: MoEShape, inputs: dict, dys: list, fp8: str | None = None) -> dict:
    """fp32 gradients of every rank's inputs through the reference's explicit backward, one
    expert rank at a time (so a preset's full expert set never exists in fp32 at once): rank
    c's experts see every rank's tokens routed to them. -> dict of per-rank lists x,
    router_logits, w1, w2 and single shared_w1, shared_w2 (summed over ranks' tokens). `fp8`
    ("fp8" | "mxfp8"): the routed experts' GEMMs quantize as the fp8 kernels do."""
    R, n, k = len(inputs["x"]), inputs["x"][0].shape[0], shape.topk
    L = shape.num_experts // R
    x = torch.cat([t.float() for t in inputs["x"]])
    z = torch.cat([t.float() for t in inputs["router_logits"]])
    dy = torch.cat([d.float() for d in dys])
    experts, weights = reference.route(z, k)
    dx = torch.zeros_like(x)
    dweights = torch.zeros_like(weights)
    out = {"w1": [], "w2": []}
    shared = [None if inputs[k_] is None else inputs[k_].float()
              for k_ in ("shared_w1", "shared_w2")]
    for c in range(R):
        local = experts - c * L  # other ranks' experts fall outside [0, L): not matched
        sh = shared if c == 0 else [None, None]
        gx, gw, g1, g2, gs1, gs2 = reference.moe_backward_routed(
            x, local, weights, inputs["w1"][c].float(), inputs["w2"][c].float(), *sh, dy, fp8)
        dx += gx
        mine = (local >= 0) & (local < L)
        dweights[mine] = gw[mine]
        out["w1"].append(g1)
        out["w2"].append(g2)
        if c == 0:
            out["shared_w1"], out["shared_w2"] = gs1, gs2
    dz = reference.router_backward(z, experts, dweights)
    out["x"] = list(dx.split(n))
    out["router_logits"] = list(dz.split(n))
    return out


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().flatten(), b.float().flatten()
    return (a @ b / (a.norm() * b.norm()).clamp_min(1e-30)).item()


def side_by_side_layers(shape: MoEShape, ep: int, tokens: int, **common) -> dict:
    """"side by side" / "one after another" -> the arguments of mokgen.plan / mokgen.compile
    for one layer on `ep` virtual ranks each: the first leaves room for every rank's
    megakernel at once (reserve_sms: the runtime then runs them side by side, as real ranks
    run), the second makes the same decisions on every SM (the ranks' kernels one after
    another). Only the CTA count differs, so outputs and gradients must be bitwise equal
    (every element is one tile's, in a fixed K order, whichever CTA takes it). ep 2: a plan
    reserves at most half the SMs."""
    import mokgen
    from mokgen.compiler import hardware

    sms = hardware.target(common.get("gpu"), common.get("arch")).num_sms
    apart = dict(common, ep=ep, tokens_per_rank=tokens, reserve_sms=sms - sms // ep)
    p = mokgen.plan(shape, **apart)
    return {"side by side": apart,
            "one after another": dict(apart, reserve_sms=0, minibatch=p.minibatch,
                                      macrobatch=p.macrobatch, comm_sms_fwd=p.comm_sms_fwd,
                                      comm_sms_bwd=p.comm_sms_bwd)}
