"""How fast is the layer in fp8? Rank 0's slice of each preset (as benchmarks/moe_layer.py),
our bf16, blockwise fp8 ("fp8") and MXFP8 ("mxfp8") layers on the same inputs, beside PyTorch:
  grouped      torch._grouped_mm pipeline in bf16 (mokgen.harness.bench.TorchSlice.grouped)
  scaled       the same pipeline through torch._scaled_grouped_mm with fp8 rows and weights
               (rowwise scales: what PyTorch offers on sm_90), where it runs
  floor bf16   dense cuBLAS GEMMs of the same FLOPs;  floor fp8: the routed GEMMs through
               torch._scaled_mm (rowwise fp8), the shared ones bf16 as ours
Weights are quantized once per weight version (outside the timed call; its cost is timed
separately as quant_ms). --backward also times each format's backward slice (after its
forward with save=True) and its gradients' error against bf16's.

    python benchmarks/fp8.py [--shapes a,b] [--ep 64,8] [--tokens 2048] [--backward] [--out DIR]

Rows go into DIR/fp8.json (rows per GPU kind, benchmarks/result_file.py) and DIR/fp8.png
(this run's forward TFLOP/s); a table is printed.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import mokgen  # noqa: E402
from mokgen.harness.bench import TorchSlice, dense_floor, make_slice, own_combine_rows, time_ms  # noqa: E402
from mokgen.harness.plot import plot  # noqa: E402
from mokgen.harness.workloads import rel_error  # noqa: E402

import result_file  # noqa: E402

E4M3 = torch.float8_e4m3fn
IMPLS = (("bf16", "mokgen bf16"), ("fp8", "mokgen fp8 (blockwise)"), ("mxfp8", "mokgen MXFP8"),
         ("grouped", "torch _grouped_mm bf16"), ("floor_bf16", "dense bf16 floor"),
         ("floor_fp8", "dense fp8 floor (rowwise _scaled_mm)"))


def rowwise(t):
    """Per-row fp8 along the last dim (the GEMM's K): -> (e4m3 q, fp32 s [..., 1]) with
    t ~= q * s. s is the dequant multiplier (amax / 448), which is what torch's rowwise
    _scaled_mm / _scaled_grouped_mm take (their epilogue computes acc * scale_a * scale_b).
    The clamp keeps a quotient rounded just past 448 from the non-saturating cast's NaN."""
    s = t.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    return (t.float() / s).clamp(-448.0, 448.0).to(E4M3), s


class ScaledSlice(TorchSlice):
    def __init__(self, *a):
        super().__init__(*a)
        L, I2, D = self.w1.shape
        q1, s1 = rowwise(self.w1)   # [L, 2I, D], [L, 2I, 1]
        q2, s2 = rowwise(self.w2)   # [L, D, I], [L, D, 1]
        self.q1, self.s1 = q1, s1.squeeze(-1)
        self.q2, self.s2 = q2, s2.squeeze(-1)

    def scaled(self, all_routes, all_weights):
        """The grouped pipeline with fp8 GEMMs. torch._scaled_grouped_mm, 2D x 3D (checked
        against torch's meta function, GroupedBlas.cpp _scaled_grouped_mm_cuda and
        test_matmul_cuda.py test_scaled_grouped_gemm_2d_3d; check_scaled_grouped_mm below
        verifies it on the GPU): A [total_M, K] e4m3 row-major; B [G, K, N] e4m3 column-major
        (the transpose of contiguous [G, N, K]); scale_a fp32 1-D [total_M] (one per row of
        A); scale_b fp32 [G, N] (one per output column per group, last dim contiguous); both
        dequant multipliers; offs int32 [G] = cumulative row ends (empty groups allowed);
        out_dtype bf16 (the only one); N and K multiples of 16. Group rows need no 16-row
        alignment in 2D x 3D (A, out and scale_a pointers advance by whole rows), but each
        expert's rows are padded to a multiple of 16 anyway, as torchao's MoE path does
        (zero rows: q = 0, so they contribute nothing and their outputs are dropped)."""
        n, D = self.X.shape[1], self.X.shape[2]
        local = self._routes(all_routes)
        idx = (local < self.L).nonzero().squeeze(1)
        idx = idx[torch.argsort(local[idx], stable=True)]
        e = local[idx]
        counts = torch.bincount(e, minlength=self.L)
        padded = (counts + 15) // 16 * 16
        ends = torch.cumsum(padded, 0)
        dest = torch.arange(len(idx), device=idx.device) - (torch.cumsum(counts, 0) - counts)[e] \
            + (ends - padded)[e]
        total = int(padded.sum())  # one host sync, as grouped's nonzero
        offs = ends.to(torch.int32)

        def gemm(rows, q, s):  # pad in bf16, then quantize the padded rows
            padded_rows = rows.new_zeros(total, rows.shape[1])
            padded_rows[dest] = rows
            qa, sa = rowwise(padded_rows)   # [total, K] e4m3, [total, 1] fp32
            # scale_a 1-D [total]; s [L, N] fp32 (weight rows = output columns)
            return torch._scaled_grouped_mm(qa, q.transpose(1, 2), sa.squeeze(-1), s,
                                            offs=offs, out_dtype=torch.bfloat16)[dest]
        h = gemm(self.X.view(-1, D)[idx // self.k], self.q1, self.s1)
        I = h.shape[1] // 2
        out = gemm(F.silu(h[:, :I]) * h[:, I:], self.q2, self.s2)
        out = out * all_weights.flatten()[idx][:, None].to(out.dtype)
        return self._push_and_sum(idx, out, n, D)


def check_scaled_grouped_mm(counts=(40, 0, 16, 72), K=256, N=128, align=16, seed=0,
                            device="cuda"):
    """Self-check of the convention `ScaledSlice.scaled` uses: torch._scaled_grouped_mm on a
    small random 2D x 3D case (group row counts `counts` rounded up to `align`; align=1
    tries unpadded groups; the 0 is an empty group) against the fp32 matmul of the
    dequantized operands, group by group. Rows and weight channels get spread magnitudes,
    so a scale applied to the wrong row, column or group shows. Both sides multiply the same
    fp8 values: -> relative error, ~1e-3 (bf16 output rounding) when the call is right."""
    g = torch.Generator(device=device).manual_seed(seed)
    rows = [-(-c // align) * align for c in counts]
    G, M = len(rows), sum(rows)
    spread = lambda *s: torch.exp(torch.randn(*s, 1, device=device, generator=g))  # noqa: E731
    x = torch.randn(M, K, device=device, generator=g) * spread(M)
    w = torch.randn(G, N, K, device=device, generator=g) * spread(G, N)
    qa, sa = rowwise(x)                      # [M, K], [M, 1]
    qb, sb = rowwise(w)                      # [G, N, K], [G, N, 1]
    offs = torch.tensor(rows, device=device).cumsum(0).to(torch.int32)
    out = torch._scaled_grouped_mm(qa, qb.transpose(1, 2), sa.squeeze(-1), sb.squeeze(-1),
                                   offs=offs, out_dtype=torch.bfloat16)
    ref = torch.zeros(M, N, device=device)
    start = 0
    for e, r in enumerate(rows):
        a = qa[start:start + r].float() * sa[start:start + r]
        ref[start:start + r] = a @ (qb[e].float() * sb[e]).T
        start += r
    return rel_error(out, ref)


def fp8_floor(shape, n, g):
    """Routed GEMMs (N k rows) in rowwise fp8 through torch._scaled_mm, shared ones bf16."""
    D, I, k, IS = shape.hidden, shape.intermediate, shape.topk, shape.shared_dim
    rn = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    a, sa = rowwise(rn(n * k, D))
    b, sb = rowwise(rn(2 * I, D))
    c, sc = rowwise(rn(n * k, I))
    d, sd = rowwise(rn(D, I))
    bf = lambda: None  # noqa: E731
    if IS:
        x, w1s = rn(n, D).bfloat16(), rn(D, 2 * IS).bfloat16()
        hs, w2s = rn(n, IS).bfloat16(), rn(IS, D).bfloat16()
        bf = lambda: (x @ w1s, hs @ w2s)  # noqa: E731
    return lambda: (torch._scaled_mm(a, b.t(), sa, sb.t(), out_dtype=torch.bfloat16),
                    torch._scaled_mm(c, d.t(), sc, sd.t(), out_dtype=torch.bfloat16), bf())


def bench(name, ep, n, iters, g, backward=False):
    shape = mokgen.shapes.get(name)
    xs, zs, w1, w2, sw1, sw2 = make_slice(shape, ep, n, g)
    args = (xs, zs, [w1] * ep, [w2] * ep, sw1, sw2)
    res = dict(shape=name, ep=ep, tokens=n, flops=shape.forward_flops(n))
    ys, grads = {}, {}
    dys = [torch.randn(x.shape, device=x.device, generator=g).bfloat16() for x in xs]
    for dt in ("bf16", "fp8", "mxfp8"):
        layer = mokgen.compile(shape, ep=ep, dtype=dt, tokens_per_rank=n, virtual=True)
        rt = layer.runtime()
        layer(x=xs, router_logits=zs, w1=[w1] * ep, w2=[w2] * ep, shared_w1=sw1, shared_w2=sw2)
        ours = lambda: rt.forward_rank(0, *args)  # noqa: E731
        ys[dt] = ours().clone()
        # the rows rank 0's experts pushed to rank 0: compared with the scaled baseline's
        mine = rt.peers.bufs["routes"][0][0].long() < shape.num_experts // ep
        if dt == "bf16":
            combine16 = own_combine_rows(rt, mine)  # (a masked copy)
        else:
            res[f"{dt}_routed_err_vs_bf16"] = rel_error(own_combine_rows(rt, mine), combine16)
        res[f"{dt}_ms"] = time_ms(ours, iters)
        res[f"{dt}_plan"] = dict(comm_sms=layer.plan.comm_sms_fwd, minibatch=layer.plan.minibatch)
        if dt != "bf16":
            res[f"{dt}_quant_ms"] = time_ms(lambda: (rt.weights.quantize(w1),
                                                     rt.weights.quantize(w2)), 5, warmup=1)
            res[f"{dt}_err_vs_bf16"] = rel_error(ys[dt], ys["bf16"])
        if backward:
            bwd = layer.backward_runtime()
            fwd = lambda: rt.forward_rank(0, *args, save=True)  # noqa: E731
            back = lambda: bwd.backward_rank(0, dys, xs, [w1] * ep, [w2] * ep, sw1, sw2)  # noqa
            fwd()
            grads[dt] = [t.clone() for t in back()[:3]]  # dx, dw1, dw2 of rank 0
            res[f"{dt}_bwd_ms"] = time_ms(back, iters, setup=fwd)
            if dt != "bf16":
                for k, got, want in zip(("dx", "dw1", "dw2"), grads[dt], grads["bf16"]):
                    res[f"{dt}_bwd_err_{k}"] = rel_error(got, want)
            del bwd, fwd, back
        all_routes = rt.peers.bufs["routes"][0].long()
        all_weights = rt.peers.bufs["weights"][0]
        del layer, rt, ours
        gc.collect()
        torch.cuda.empty_cache()
    ts = ScaledSlice(shape, ep, xs, zs, w1, w2, sw1, sw2)
    res["grouped_ms"] = time_ms(lambda: ts.grouped(all_routes, all_weights), iters)
    try:
        # rank 0's routes to its own experts: the rows both computed (y also holds the
        # rows other ranks' experts pushed, which the slice does not recompute)
        res["scaled_err_vs_bf16"] = rel_error(ts.scaled(all_routes, all_weights)[1][mine],
                                              combine16[mine])
        res["scaled_ms"] = time_ms(lambda: ts.scaled(all_routes, all_weights), iters)
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        res["scaled_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    res["floor_bf16_ms"] = time_ms(dense_floor(shape, n, "cuda", g), iters)
    try:
        res["floor_fp8_ms"] = time_ms(fp8_floor(shape, n, g), iters)
    except Exception as e:  # noqa: BLE001
        res["floor_fp8_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    for k in [k for k in res if k.endswith("_ms") and not k.endswith("quant_ms")]:
        res[k[:-3] + "_tflops"] = res["flops"] * (2 if "_bwd" in k else 1) / res[k] / 1e9
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(prog="benchmarks/fp8.py", description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="kimi-k2.7,glm-5.2,qwen3.5-397b-a17b,deepseek-v4-pro",
                    help="comma list of presets (default: %(default)s)")
    ap.add_argument("--ep", default="64,8", help="comma list of EP degrees (default: %(default)s)")
    ap.add_argument("--tokens", default="2048", help="comma list of tokens per rank")
    ap.add_argument("--iters", type=int, default=30, help="timed calls a measurement")
    ap.add_argument("--out", default=result_file.RESULTS,
                    help="folder of fp8.json (default: %(default)s)")
    ap.add_argument("--backward", action="store_true", help="also time the backward slices")
    a = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for ep in map(int, a.ep.split(",")):
        for name in a.shapes.split(","):
            for n in map(int, a.tokens.split(",")):
                r = bench(name, ep, n, a.iters, g, a.backward)
                r["measured"] = "fwd+bwd" if a.backward else "fwd"
                print(json.dumps(r), flush=True)
                rows.append(r)
    path = result_file.write(
        "fp8", rows, ("shape", "ep", "tokens", "measured"), out=a.out,
        plot=lambda j, p: plot(j, p, impls=IMPLS, what="MoE layer forward, bf16 / fp8 / MXFP8"))
    print(f"\nwrote {path}\nTFLOP/s (6 N (k+1) D I / t)")
    print(f"{'shape':<18}{'ep':>3}{'N':>6} {'bf16':>6} {'fp8':>6} {'mxfp8':>6} {'grp':>6} "
          f"{'scaled':>6} {'fl16':>6} {'fl8':>6}  fp8/bf16 mx/bf16 fp8/best  err fp8/mx")
    for r in rows:
        t = lambda k: r.get(f"{k}_tflops", float("nan"))  # noqa: E731
        # a wrong result is no baseline: the scaled pipeline's routed rows may be off bf16 by
        # at most twice as much as ours
        valid = r.get("scaled_err_vs_bf16", 1.0) <= 2 * r["fp8_routed_err_vs_bf16"]
        best = max(t("grouped"), t("scaled") if valid and "scaled_tflops" in r else 0)
        print(f"{r['shape']:<18}{r['ep']:>3}{r['tokens']:>6} {t('bf16'):6.0f} {t('fp8'):6.0f} "
              f"{t('mxfp8'):6.0f} {t('grouped'):6.0f} {t('scaled'):6.0f} {t('floor_bf16'):6.0f} "
              f"{t('floor_fp8'):6.0f}  {t('fp8') / t('bf16'):8.2f} {t('mxfp8') / t('bf16'):7.2f} "
              f"{t('fp8') / best:8.2f}  {r['fp8_err_vs_bf16']:.1e}/{r['mxfp8_err_vs_bf16']:.1e}")
    print("routed rows vs bf16: fp8 / mxfp8 / scaled  "
          + "  ".join(f"{r['shape'][:6]}-{r['ep']}: {r['fp8_routed_err_vs_bf16']:.3f}/"
                      f"{r['mxfp8_routed_err_vs_bf16']:.3f}/{r.get('scaled_err_vs_bf16', -1):.3f}"
                      for r in rows))
    if a.backward:
        print(f"\nbackward TFLOP/s (12 N (k+1) D I / t)\n{'shape':<18}{'ep':>3}{'N':>6} "
              f"{'bf16':>6} {'fp8':>6} {'mxfp8':>6}  fp8/bf16 mx/bf16  dx err fp8/mx")
        for r in rows:
            t = lambda k: r.get(f"{k}_bwd_tflops", float("nan"))  # noqa: E731
            print(f"{r['shape']:<18}{r['ep']:>3}{r['tokens']:>6} {t('bf16'):6.0f} {t('fp8'):6.0f} "
                  f"{t('mxfp8'):6.0f}  {t('fp8') / t('bf16'):8.2f} {t('mxfp8') / t('bf16'):7.2f}"
                  f"  {r['fp8_bwd_err_dx']:.1e}/{r['mxfp8_bwd_err_dx']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
