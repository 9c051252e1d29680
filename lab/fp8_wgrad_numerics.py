"""Does quantizing the weight gradients too (issue 63: DeepSeek-V3's recipe) move the loss?
A CPU emulation, before any kernel: a small char-level MoE LM on tiny-shakespeare, every
routed-expert GEMM computed on fake-quantized operands (mokgen.quant.fake_quant: the values
the fp8 kernels multiply, fp32 sums), each quantized along its own K:

  bf16       no quantization (fp32 math; the reference the others are held against)
  fp8        forward and activation gradients in blockwise e4m3 (what dtype="fp8" runs today:
             x, h along D / I with 1 x 128 scales, W1, W2 in 128 x 128 blocks)
  fp8-wgrad  fp8 and the weight gradients: dW1 = dh^T x and dW2 = (s dy)^T a with both
             operands quantized along the tokens (1 x 128 scales), as the kernels would

The model sees the last `--context` characters (an embedding per offset, summed: no attention),
so its MoE layers have more to learn than bigram counts. Every other part (embeddings, norms,
router, head) in fp32. Seeds: the bf16 runs' spread is the
noise band the other two are read against. Writes JSON (per-step losses) and prints the table.

    python lab/fp8_wgrad_numerics.py --text /path/input.txt --steps 600 --out /tmp/fp8w.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn

from mokgen.quant import fake_quant

VARIANTS = {"bf16": (False, False), "fp8": (True, False), "fp8-wgrad": (True, True)}


class QuantLinear(torch.autograd.Function):
    """y = a @ w.T on fake-quantized operands; the backward's two GEMMs quantize theirs along
    their own K: dA = dy @ w along the output features, dW = dy^T a along the rows (tokens)."""

    @staticmethod
    def forward(ctx, a, w, fwd: bool, wgrad: bool):
        ctx.save_for_backward(a, w)
        ctx.fwd, ctx.wgrad = fwd, wgrad
        if not fwd:
            return a @ w.T
        return fake_quant(a, "fp8") @ fake_quant(w, "fp8", weight=True).T

    @staticmethod
    def backward(ctx, dy):
        a, w = ctx.saved_tensors
        if ctx.fwd:  # dgrad: dy (bf16 in the kernels, then quantized) along the output
            # features, w^T quantized in its own blocks
            dy = dy.to(torch.bfloat16).float()
            da = fake_quant(dy, "fp8") @ fake_quant(w.T.contiguous(), "fp8", weight=True).T
        else:
            da = dy @ w
        if ctx.wgrad:  # both operands token-major, 1 x 128 along the tokens
            dw = fake_quant(dy.T.contiguous(), "fp8") @ fake_quant(a.T.contiguous(), "fp8").T
        else:
            dw = dy.T @ a
        return da, dw, None, None


class MoE(nn.Module):
    """Top-k softmax routing (renormalized), SwiGLU experts with gate and up in one w1."""

    def __init__(self, d, i, experts, topk):
        super().__init__()
        self.topk = topk
        self.router = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, 2 * i, d) * d ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, d, i) * i ** -0.5)
        self.mode = (False, False)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat).float(), -1)
        weights, experts = probs.topk(self.topk, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in range(self.w1.shape[0]):
            tok, slot = (experts == e).nonzero(as_tuple=True)
            if len(tok) == 0:
                continue
            gate, up = QuantLinear.apply(flat[tok], self.w1[e], *self.mode).chunk(2, -1)
            h = (F.silu(gate) * up).to(torch.bfloat16).float()  # the kernels keep h in bf16
            y = QuantLinear.apply(h, self.w2[e], *self.mode)
            out = out.index_add(0, tok, y * weights[tok, slot, None])
        return out.reshape(x.shape)


class LM(nn.Module):
    def __init__(self, vocab, d, i, experts, topk, layers, context):
        super().__init__()
        self.embeds = nn.ModuleList(nn.Embedding(vocab, d) for _ in range(context))
        self.norms = nn.ModuleList(nn.RMSNorm(d) for _ in range(layers))
        self.moes = nn.ModuleList(MoE(d, i, experts, topk) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        """ids [B, context - 1 + T] -> logits [B, T, vocab] for the last T positions."""
        c, t = len(self.embeds), ids.shape[1] - len(self.embeds) + 1
        h = sum(e(ids[:, c - 1 - j: c - 1 - j + t]) for j, e in enumerate(self.embeds))
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        return self.head(h)


def run(text: torch.Tensor, vocab: int, variant: str, seed: int, a) -> list:
    torch.manual_seed(seed)
    model = LM(vocab, a.hidden, a.intermediate, a.experts, a.topk, a.layers, a.context)
    for m in model.moes:
        m.mode = VARIANTS[variant]
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    data = torch.Generator().manual_seed(1234)  # the same batches for every variant and seed
    losses = []
    for _ in range(a.steps):
        n = a.context + a.seq
        at = torch.randint(0, len(text) - n, (a.batch,), generator=data)
        ids = torch.stack([text[j: j + n] for j in at.tolist()])
        loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, vocab),
                               ids[:, a.context:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def smoothed_final(losses: list, window: int) -> float:
    return sum(losses[-window:]) / len(losses[-window:])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", required=True, help="a text file (tiny-shakespeare input.txt)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=8, help="characters each position sees")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--runs", default="bf16:0,bf16:1,bf16:2,fp8:0,fp8-wgrad:0",
                    help="VARIANT:SEED,... (variants: " + ", ".join(VARIANTS) + ")")
    ap.add_argument("--window", type=int, default=50, help="steps the final loss averages")
    ap.add_argument("--out", default=None, help="JSON of every run's per-step losses")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    raw = open(a.text, encoding="utf-8").read()
    chars = sorted(set(raw))
    text = torch.tensor([chars.index(c) for c in raw], dtype=torch.long)
    out = {"args": vars(a), "runs": {}}
    for r in a.runs.split(","):
        variant, seed = r.split(":")
        t0 = time.time()
        losses = run(text, len(chars), variant, int(seed), a)
        out["runs"][r] = dict(variant=variant, seed=int(seed), losses=losses,
                              final=smoothed_final(losses, a.window), seconds=time.time() - t0)
        print(f"{r:<14} final {out['runs'][r]['final']:.4f}  ({time.time() - t0:.0f} s)",
              flush=True)
    base = [v["final"] for v in out["runs"].values() if v["variant"] == "bf16"]
    if base:
        mean = sum(base) / len(base)
        print(f"bf16 seeds: final {min(base):.4f} .. {max(base):.4f} "
              f"(band {100 * (max(base) - min(base)) / mean:.2f}% of the mean)")
        for r, v in out["runs"].items():
            if v["variant"] != "bf16":
                ref = out["runs"].get(f"bf16:{v['seed']}")
                rel = (v["final"] / ref["final"] - 1) if ref else float("nan")
                gap = max(abs(x - y) for x, y in zip(v["losses"], ref["losses"])) if ref else 0
                print(f"{r:<14} final {v['final']:.4f}: {100 * rel:+.2f}% against bf16 of its "
                      f"seed; curves' largest step gap {gap:.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
