"""Train a small MoE language model on R processes: FSDP2 (`fully_shard`) shards the dense
parameters (embedding, norms, routers, shared experts, head), the routed experts are expert
parallel over the same R ranks (EP = R: rank r holds experts r*L .. r*L+L-1, FSDP ignores them)
through mokgen.MoE or a torch-native EP MoE (NCCL all_to_all + grouped_mm,
mokgen.harness.ep_baseline). Each rank trains on its own batch. Rank 0 also trains the single-process
reference (every expert local, the global batch, the same initial weights) and compares the
losses step by step; the distributed model's tokens/s is timed after a warm-up.

    torchrun --nproc-per-node=2 examples/04_train_fsdp_ep.py --moe mokgen
    torchrun --nproc-per-node=2 examples/04_train_fsdp_ep.py --moe torch   # also on CPU (gloo)

With --moe mokgen the layers are planned with overlap_comm=True (SMs left to FSDP's gathers
and reduce-scatters; pass --no-overlap to compare). Prints a JSON summary (rank 0).
"""
import argparse
import gc
import importlib
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

import mokgen
from mokgen.harness.ep_baseline import EPBaseline, dist_exchange

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
markov_batches = importlib.import_module("03_train_small_lm").markov_batches
# FSDP2 warns that the layers return views (reshape); every use here is out of place
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
SHAPE = mokgen.MoEShape(16, 512, 256, 2, name="lm")  # experts: --experts

class TorchEPMoE(nn.Module):
    """The EP layer users write with NCCL and PyTorch; parameters named and laid out like
    mokgen.MoE's. ranks=1 (exchange None) is the single-process reference."""

    def __init__(self, shape, ranks, exchange, dtype, grouped):
        super().__init__()
        E, D, I, L, Is = (shape.num_experts, shape.hidden, shape.intermediate,
                          shape.num_experts // ranks, shape.shared_dim)
        self.shape, self.ranks, self.grouped = shape, ranks, grouped
        self.exchange = exchange or (lambda t, out_splits, in_splits: t)
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(L, 2 * I, D, dtype=dtype) * D**-0.5)
        self.w2 = nn.Parameter(torch.randn(L, D, I, dtype=dtype) * I**-0.5)
        self.shared_w1 = nn.Parameter(torch.randn(2 * Is, D, dtype=dtype) * D**-0.5)
        self.shared_w2 = nn.Parameter(torch.randn(D, Is, dtype=dtype) * Is**-0.5)

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        layer = EPBaseline(self.shape, self.ranks, self.w1, self.w2, self.shared_w1,
                           self.shared_w2, self.exchange, self.grouped)
        y = layer(x2.to(self.w1.dtype), self.router(x2).float())
        return y.to(x.dtype).reshape(x.shape)


class TinyMoELM(nn.Module):
    def __init__(self, shape, layers, make_moe):
        super().__init__()
        self.embed = nn.Embedding(256, shape.hidden)
        self.norms = nn.ModuleList(nn.RMSNorm(shape.hidden) for _ in range(layers))
        self.moes = nn.ModuleList(make_moe() for _ in range(layers))
        self.head = nn.Linear(shape.hidden, 256)

    def forward(self, ids):
        h = self.embed(ids)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        return self.head(h)

    def experts(self):
        return [p for m in self.moes for p in (m.w1, m.w2)]


def gather_experts(model, R):
    """Every rank's local experts, concatenated in rank order (global expert order)."""
    out = []
    for p in model.experts():
        parts = [torch.empty_like(p.data) for _ in range(R)]
        dist.all_gather(parts, p.data.contiguous())
        out.append(torch.cat(parts))
    return out


def build(args, shape, R, rank, dev, dtype):
    tokens = args.batch * args.seq
    group = dist.group.WORLD
    extra = {} if args.no_overlap else {"overlap_comm": True}

    def make():
        if args.moe == "mokgen":
            return mokgen.MoE(shape, ep_group=group, tokens_per_rank=tokens, **extra)
        return TorchEPMoE(shape, R, dist_exchange(group), dtype, grouped=dev.type == "cuda")
    torch.manual_seed(0)  # dense parameters: the same on every rank
    model = TinyMoELM(shape, args.layers, make).to(dev)
    with torch.no_grad():  # routed experts: each rank its own
        g = torch.Generator(device="cpu").manual_seed(1000 + rank)
        for p in model.experts():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    ref = None
    full = gather_experts(model, R)
    if rank == 0:
        torch.manual_seed(0)
        ref = TinyMoELM(shape, args.layers,
                        lambda: TorchEPMoE(shape, 1, None, dtype, dev.type == "cuda")).to(dev)
        dense = {k: v for k, v in model.state_dict().items() if not k.endswith((".w1", ".w2"))}
        ref.load_state_dict(dense, strict=False)  # the experts below
        with torch.no_grad():
            for p, w in zip(ref.experts(), full):
                p.copy_(w)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dev.type, (R,))
    for moe in model.moes:  # one FSDP unit per layer: its gathers overlap the layer before
        fully_shard(moe.router, mesh=mesh)  # fp32, the shared expert bf16: a unit holds one dtype
        fully_shard(moe, mesh=mesh, ignored_params={moe.w1, moe.w2})
    fully_shard(model, mesh=mesh, ignored_params=set(model.experts()))
    return model, ref


def step(model, opt, ids, scale_experts=1.0):
    logits = model(ids[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, 256).float(), ids[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    if scale_experts != 1.0:  # the global loss is the ranks' mean: FSDP averages the dense
        for p in model.experts():  # grads; a rank's experts got every rank's sum
            p.grad.mul_(scale_experts)
    opt.step()
    return loss.detach()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe", choices=("mokgen", "torch"), default="mokgen")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of tokens/s")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--no-overlap", action="store_true", help="mokgen: reserve no SMs")
    ap.add_argument("--expert-dtype", choices=("auto", "bf16", "fp32"), default="auto",
                    help="routed and shared experts (auto: bf16 on GPUs, fp32 on CPU)")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        for k in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE"):
            os.environ[k] = "1" if k.startswith("TORCH") else "0"
        if args.moe == "mokgen" and not args.no_overlap:  # NCCL (FSDP) within the SMs the
            from mokgen.compiler.passes.sm_partition import collective_sms  # layers leave free

            sms = collective_sms(mokgen.compiler.hardware.default())  # this node's GPU
            os.environ.setdefault("NCCL_MAX_CTAS", str(sms))
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        dev = torch.device("cuda", local)
    else:
        if args.moe == "mokgen":
            raise SystemExit("--moe mokgen needs CUDA GPUs (the kernels); use --moe torch")
        dist.init_process_group("gloo")
        dev = torch.device("cpu")
    R, rank = dist.get_world_size(), dist.get_rank()
    shape = SHAPE if args.experts == SHAPE.num_experts else \
        mokgen.MoEShape(args.experts, 512, 256, 2, name="lm")
    dtype = torch.bfloat16 if args.expert_dtype == "bf16" or (
        args.expert_dtype == "auto" and cuda) else torch.float32
    model, ref = build(args, shape, R, rank, dev, dtype)
    # foreach=False: the parameters mix FSDP's DTensors and the experts' plain tensors
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3) if ref is not None else None
    losses, ref_losses, t0 = [], [], None
    for i, ids in enumerate(markov_batches(args.steps, args.batch, args.seq, "cpu",
                                           seed=rank)):
        if i == args.warmup:
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
        ids = ids.to(dev)
        loss = step(model, opt, ids, 1.0 / R)
        dist.all_reduce(loss)
        losses.append(loss.item() / R)
        if not args.no_reference:  # rank 0 trains the reference on the global batch
            every = [torch.empty_like(ids) for _ in range(R)]
            dist.all_gather(every, ids)
            if ref is not None:
                ref_losses.append(step(ref, ref_opt, torch.cat(every)).item())
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - t0 if t0 else float("nan")
    timed = args.steps - args.warmup
    if rank == 0:
        summary = dict(moe=args.moe, ranks=R, device=str(dev), steps=args.steps,
                       overlap_comm=args.moe == "mokgen" and not args.no_overlap,
                       tokens_per_s=R * args.batch * args.seq * timed / seconds,
                       first=losses[0], last=losses[-1],
                       note="the reference trains beside the model: tokens/s includes it "
                            "unless --no-reference")
        if ref_losses:
            summary.update(ref_first=ref_losses[0], ref_last=ref_losses[-1],
                           max_rel_gap=max(abs(a - b) / b for a, b in zip(losses, ref_losses)))
        print(json.dumps(summary, indent=1))
        if args.out:
            json.dump(dict(summary, losses=losses, ref_losses=ref_losses), open(args.out, "w"))
    # the ranks leave together, and drop what holds the process group (FSDP's DTensors and
    # their mesh) before it is destroyed: left to the interpreter's exit, a rank could abort
    # there ("terminate called without an active exception", seen on a busy CPU)
    dist.barrier()
    del model, ref, opt, ref_opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
