"""Train a small MoE language model with mokgen.MoE, side by side with the same model using the
PyTorch reference MoE (same init, same data), and compare the losses step by step.

The data is a fixed random Markov chain over 256 symbols, so the loss has somewhere to go.
Needs a GPU for the kernels (on CPU both models run the reference). Prints a JSON summary.
"""
import argparse
import copy
import json

import torch
from torch import nn

import mokgen


class TinyMoELM(nn.Module):
    def __init__(self, shape, layers, tokens, backend):
        super().__init__()
        self.embed = nn.Embedding(256, shape.hidden)
        self.norms = nn.ModuleList(nn.RMSNorm(shape.hidden) for _ in range(layers))
        self.moes = nn.ModuleList(mokgen.MoE(shape, tokens_per_rank=tokens, backend=backend)
                                  for _ in range(layers))
        self.head = nn.Linear(shape.hidden, 256)

    def forward(self, ids):
        h = self.embed(ids)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        return self.head(h)


def markov_batches(steps, batch, seq, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    trans = torch.softmax(torch.randn(256, 256, generator=g) * 3, dim=-1)
    for _ in range(steps):
        ids = torch.empty(batch, seq + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, 256, (batch,), generator=g)
        for t in range(seq):
            ids[:, t + 1] = torch.multinomial(trans[ids[:, t]], 1, generator=g).squeeze(1)
        yield ids.to(device)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shape = mokgen.MoEShape(num_experts=16, hidden=512, intermediate=256, topk=2, name="lm")
    tokens = args.batch * args.seq
    torch.manual_seed(0)
    ours = TinyMoELM(shape, 2, tokens, "kernels").to(dev)
    ref = TinyMoELM(shape, 2, tokens, "reference").to(dev)
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (ours, ref)]
    losses = {"mokgen": [], "reference": []}
    for ids in markov_batches(args.steps, args.batch, args.seq, dev):
        for name, model, opt in (("mokgen", ours, opts[0]), ("reference", ref, opts[1])):
            logits = model(ids[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 256).float(),
                                               ids[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    a, b = losses["mokgen"], losses["reference"]
    gap = max(abs(x - y) / y for x, y in zip(a, b))
    summary = dict(device=dev, steps=args.steps, first=(a[0], b[0]), last=(a[-1], b[-1]),
                   max_rel_gap=gap, every_50=[(i, a[i], b[i]) for i in range(0, len(a), 50)])
    print(json.dumps(summary, indent=1))
    if args.out:
        json.dump(dict(summary, losses=losses), open(args.out, "w"))
    return summary


if __name__ == "__main__":
    main()
