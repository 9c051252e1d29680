"""One tree's layer slice, forward and backward, on fixed random inputs: the outputs and
gradients saved (to compare two trees bitwise) and the times printed. Run once per tree with
that tree's PYTHONPATH and MOKGEN_CACHE (lab/prepare_ab.sh's layout), then compare.

  python lab/ab_fp8_bwd.py run SHAPE EP N DTYPE OUT.pt
  python lab/ab_fp8_bwd.py compare A.pt B.pt
"""
import sys

import torch


def run(shape_name, ep, n, dtype, out):
    import mokgen
    from mokgen.harness.bench import make_slice, time_ms

    shape = mokgen.shapes.get(shape_name)
    g = torch.Generator(device="cuda").manual_seed(1234)
    xs, zs, w1, w2, sw1, sw2 = make_slice(shape, ep, n, g)
    dys = [torch.randn(x.shape, device="cuda", generator=g).bfloat16() for x in xs]
    layer = mokgen.compile(shape, ep=ep, dtype=dtype, tokens_per_rank=n, virtual=True)
    rt = layer.runtime()
    args = (xs, zs, [w1] * ep, [w2] * ep, sw1, sw2)
    layer(x=xs, router_logits=zs, w1=[w1] * ep, w2=[w2] * ep, shared_w1=sw1, shared_w2=sw2)
    bwd = layer.backward_runtime()
    fwd = lambda: rt.forward_rank(0, *args, save=True)  # noqa: E731
    back = lambda acc=None: bwd.backward_rank(  # noqa: E731
        0, dys, xs, [w1] * ep, [w2] * ep, sw1, sw2, accumulate=acc)
    y = fwd().clone()
    grads = [t.clone() if t is not None else None for t in back()]
    # fused gradient accumulation: the expert gradients added into random ones
    acc = tuple(torch.randn(w.shape, device="cuda", generator=g).bfloat16() for w in (w1, w2))
    fwd()
    grads += [t.clone() for t in back(tuple(a.clone() for a in acc))[1:3]]
    # the router logits' gradient (from the router weights' one), through autograd: the
    # per-rank slice above does not return it
    xl, zl = ([t.detach().requires_grad_() for t in ts] for ts in (xs, zs))
    ys = layer(x=xl, router_logits=zl, w1=[w1] * ep, w2=[w2] * ep, shared_w1=sw1, shared_w2=sw2)
    torch.autograd.backward(ys, dys)
    grads.append(torch.cat([z.grad for z in zl]))
    torch.cuda.synchronize()
    f_ms = time_ms(lambda: rt.forward_rank(0, *args), 30)
    b_ms = time_ms(back, 30, setup=fwd)
    a_ms = time_ms(lambda: back(acc), 30, setup=fwd)
    torch.save({"y": y, "grads": grads, "fwd_ms": f_ms, "bwd_ms": b_ms, "acc_ms": a_ms}, out)
    print(f"{shape_name} ep {ep} N {n} {dtype}: fwd {f_ms:.3f} ms, bwd {b_ms:.3f} ms, "
          f"bwd accumulating {a_ms:.3f} ms -> {out}")


def compare(a, b):
    A, B = torch.load(a), torch.load(b)
    names = ["y", "dx", "dw1", "dw2", "dsw1", "dsw2", "dw1 accumulated", "dw2 accumulated",
             "router logits grad"]
    ok = True
    for name, s, t in zip(names, [A["y"]] + A["grads"], [B["y"]] + B["grads"]):
        if s is None and t is None:
            continue
        same = torch.equal(s, t)
        ok &= same
        diff = (s.float() - t.float()).abs().max().item()
        nan = (s.isnan().sum().item(), t.isnan().sum().item())
        print(f"  {name}: {'bitwise equal' if same else f'differs, max |diff| {diff:.3g}'}"
              f" (NaNs {nan})")
    print(f"bwd {A['bwd_ms']:.3f} -> {B['bwd_ms']:.3f} ms ({A['bwd_ms'] / B['bwd_ms']:.3f}x), "
          f"accumulating {A['acc_ms']:.3f} -> {B['acc_ms']:.3f} ms "
          f"({A['acc_ms'] / B['acc_ms']:.3f}x), "
          f"fwd {A['fwd_ms']:.3f} -> {B['fwd_ms']:.3f} ms; {'SAME' if ok else 'DIFFERENT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    else:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
