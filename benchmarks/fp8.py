"""fp8 forward benchmark: per-rank slices (as `python -m mokgen bench`), our bf16, blockwise
fp8 ("fp8") and MXFP8 ("mxfp8") megakernels on the same inputs, next to PyTorch baselines:
  grouped      torch._grouped_mm pipeline in bf16 (mokgen.bench.TorchSlice.grouped)
  scaled       the same pipeline through torch._scaled_grouped_mm with fp8 rows and weights
               (rowwise scales: what PyTorch offers on sm_90), where it runs
  floor bf16   dense cuBLAS GEMMs of the same FLOPs;  floor fp8: the routed GEMMs through
               torch._scaled_mm (rowwise fp8), the shared ones bf16 as ours
Weights are quantized once per weight version (outside the timed call; its cost is timed
separately as quant_ms). Writes $OUT/moe_layer_fwd_fp8.json and prints a table.
Usage: python benchmarks/fp8.py [--shapes a,b] [--ep 8,64] [--tokens 1024,2048,4096]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.nn.functional as F

import mokgen
from mokgen.bench import TorchSlice, dense_floor, make_slice, save_results, time_ms
from mokgen.workloads import rel_error

E4M3 = torch.float8_e4m3fn
IMPLS = (("bf16", "mokgen bf16"), ("fp8", "mokgen fp8 (blockwise)"), ("mxfp8", "mokgen MXFP8"),
         ("grouped", "torch _grouped_mm bf16"), ("floor_bf16", "dense bf16 floor"),
         ("floor_fp8", "dense fp8 floor (rowwise _scaled_mm)"))


def rowwise(t):
    """Per-row fp8 (amax / 448), the scaling torch's sm_90 fp8 GEMMs take."""
    s = t.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    return (t.float() / s).to(E4M3), s


class ScaledSlice(TorchSlice):
    def __init__(self, *a):
        super().__init__(*a)
        L, I2, D = self.w1.shape
        q1, s1 = rowwise(self.w1)   # [L, 2I, D], [L, 2I, 1]
        q2, s2 = rowwise(self.w2)   # [L, D, I], [L, D, 1]
        self.q1, self.s1 = q1, s1.squeeze(-1)
        self.q2, self.s2 = q2, s2.squeeze(-1)

    def scaled(self, all_routes, all_weights):
        """The grouped pipeline with fp8 GEMMs. Each expert's rows are padded to a multiple
        of 16 (the fp8 grouped GEMM's alignment; zero rows, scale 1)."""
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
            qa, sa = rowwise(padded_rows)
            return torch._scaled_grouped_mm(qa, q.transpose(1, 2), sa.squeeze(-1), s,
                                            offs=offs, out_dtype=torch.bfloat16)[dest]
        h = gemm(self.X.view(-1, D)[idx // self.k], self.q1, self.s1)
        I = h.shape[1] // 2
        out = gemm(F.silu(h[:, :I]) * h[:, I:], self.q2, self.s2)
        out = out * all_weights.flatten()[idx][:, None].to(out.dtype)
        return self._push_and_sum(idx, out, n, D)


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


def bench(name, ep, n, iters, g):
    shape = mokgen.shapes.get(name)
    xs, zs, w1, w2, sw1, sw2 = make_slice(shape, ep, n, g)
    args = (xs, zs, [w1] * ep, [w2] * ep, sw1, sw2)
    res = dict(shape=name, ep=ep, tokens=n, flops=shape.forward_flops(n))
    ys = {}
    for dt in ("bf16", "fp8", "mxfp8"):
        layer = mokgen.compile(shape, ep=ep, dtype=dt, tokens_per_rank=n, virtual=True)
        rt = layer.runtime()
        layer(x=xs, router_logits=zs, w1=[w1] * ep, w2=[w2] * ep, shared_w1=sw1, shared_w2=sw2)
        ours = lambda: rt.forward_rank(0, *args)  # noqa: E731
        ys[dt] = ours().clone()
        res[f"{dt}_ms"] = time_ms(ours, iters)
        res[f"{dt}_plan"] = dict(comm_sms=layer.plan.comm_sms_fwd, minibatch=layer.plan.minibatch)
        if dt != "bf16":
            res[f"{dt}_quant_ms"] = time_ms(lambda: (rt.weights.quantize(w1),
                                                     rt.weights.quantize(w2)), 5, warmup=1)
            res[f"{dt}_err_vs_bf16"] = rel_error(ys[dt], ys["bf16"])
        all_routes = rt.peers.bufs["routes"][0].long()
        all_weights = rt.peers.bufs["weights"][0]
        del layer, rt, ours
        gc.collect()
        torch.cuda.empty_cache()
    ts = ScaledSlice(shape, ep, xs, zs, w1, w2, sw1, sw2)
    res["grouped_ms"] = time_ms(lambda: ts.grouped(all_routes, all_weights), iters)
    try:
        y = ts.scaled(all_routes, all_weights)[0]
        res["scaled_err_vs_bf16"] = rel_error(y, ys["bf16"])
        res["scaled_ms"] = time_ms(lambda: ts.scaled(all_routes, all_weights), iters)
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        res["scaled_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    res["floor_bf16_ms"] = time_ms(dense_floor(shape, n, "cuda", g), iters)
    try:
        res["floor_fp8_ms"] = time_ms(fp8_floor(shape, n, g), iters)
    except Exception as e:  # noqa: BLE001
        res["floor_fp8_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    for k in [k for k in res if k.endswith("_ms") and not k.endswith("quant_ms")]:
        res[k[:-3] + "_tflops"] = res["flops"] / res[k] / 1e9
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="kimi-k2.7,glm-5.2,qwen3.5-397b-a17b,deepseek-v4-pro")
    ap.add_argument("--ep", default="64,8")
    ap.add_argument("--tokens", default="2048")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    a = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for ep in map(int, a.ep.split(",")):
        for name in a.shapes.split(","):
            for n in map(int, a.tokens.split(",")):
                r = bench(name, ep, n, a.iters, g)
                print(json.dumps(r), flush=True)
                rows.append(r)
    meta = save_results(os.path.join(a.out, "moe_layer_fwd_fp8.json"), rows, impls=IMPLS,
                        what="MoE layer forward, bf16 / fp8 / MXFP8")
    print(f"\n{meta}\nTFLOP/s (6 N (k+1) D I / t)")
    print(f"{'shape':<18}{'ep':>3}{'N':>6} {'bf16':>6} {'fp8':>6} {'mxfp8':>6} {'grp':>6} "
          f"{'scaled':>6} {'fl16':>6} {'fl8':>6}  fp8/bf16 mx/bf16 fp8/best  err fp8/mx")
    for r in rows:
        t = lambda k: r.get(f"{k}_tflops", float("nan"))  # noqa: E731
        valid = r.get("scaled_err_vs_bf16", 1.0) <= 5e-2  # a wrong result is no baseline
        best = max(t("grouped"), t("scaled") if valid and "scaled_tflops" in r else 0)
        print(f"{r['shape']:<18}{r['ep']:>3}{r['tokens']:>6} {t('bf16'):6.0f} {t('fp8'):6.0f} "
              f"{t('mxfp8'):6.0f} {t('grouped'):6.0f} {t('scaled'):6.0f} {t('floor_bf16'):6.0f} "
              f"{t('floor_fp8'):6.0f}  {t('fp8') / t('bf16'):8.2f} {t('mxfp8') / t('bf16'):7.2f} "
              f"{t('fp8') / best:8.2f}  {r['fp8_err_vs_bf16']:.1e}/{r['mxfp8_err_vs_bf16']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
