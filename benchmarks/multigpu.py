"""Expert parallelism across GPUs, one process per GPU:

    torchrun --nproc-per-node=R benchmarks/multigpu.py [--shapes ...] [--tokens 1024,2048,4096]

Per preset, experts scaled to fit: E = R x (the preset's experts per rank at ep=64, at least
ceil(k / R)), so each GPU holds an ep=64 rank's experts and receives N*k routed rows. Every rank makes the same
global inputs (one seed) and times its own layer call; a row reports the slowest rank's median.
  mokgen        forward / forward+backward of the compiled layer (symmetric-memory peers)
  nccl+grouped  route, all_to_all_single of counts (host sync for the splits, as users do) and
                of the rows + expert ids, torch._grouped_mm experts, all_to_all_single back,
                weighted sum; backward by autograd (torch.distributed.nn all_to_all_single)
  nccl+naive    the same with a per-expert loop
  floor         max(FLOPs / 750 TFLOP/s, off-rank bytes / 450 GB/s NVLink per direction)
NVLink GB/s = the bytes that cross GPUs in dispatch + combine (rows sent to other ranks, out
and back) / the call's time: a lower bound on the links' rate. NVLink multicast stays off.
DeepEP is not built here (the GPU machines have no network to fetch its source).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mokgen  # noqa: E402
from mokgen import reference  # noqa: E402
from mokgen.bench import time_ms  # noqa: E402
from mokgen.workloads import make_inputs  # noqa: E402

PEAK_FLOPS, NVLINK_BPS = 750e12, 450e9


def slowest_ms(fn, iters):
    """The median of this rank's timed runs (mokgen.bench.time_ms), maxed over the ranks."""
    t = torch.tensor([time_ms(fn, iters, warmup=5)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


class NcclMoE:
    """The all-to-all + PyTorch baseline of one rank (holds experts r*L .. r*L+L-1)."""

    def __init__(self, shape, R, r, w1, w2, sw1, sw2, grouped=True):
        self.k, self.R, self.r, self.L = shape.topk, R, r, shape.num_experts // R
        self.w1, self.w2, self.sw1, self.sw2, self.grouped = w1, w2, sw1, sw2, grouped

    def __call__(self, x, z):
        from torch.distributed.nn.functional import all_to_all_single

        n, D, k = x.shape[0], x.shape[1], self.k
        experts, weights = reference.route(z, k)
        dest = (experts // self.L).flatten()
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=self.R)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        s_split, r_split = send.tolist(), recv.tolist()  # host sync: the splits
        rows = x[order // k]
        got = all_to_all_single(x.new_empty(sum(r_split), D), rows, r_split, s_split)
        eid = torch.empty(sum(r_split), dtype=torch.long, device=x.device)
        dist.all_to_all_single(eid, experts.flatten()[order] - self.r * self.L, r_split, s_split)
        out = self._experts(got, eid)
        back = all_to_all_single(x.new_empty(n * k, D), out, s_split, r_split)
        routed = torch.empty_like(back).index_copy(0, order, back)
        y = (routed.view(n, k, D) * weights.unsqueeze(-1).to(x.dtype)).sum(1)
        return y + reference.expert_ffn(x, self.sw1, self.sw2)

    def _experts(self, rows, eid):
        perm = torch.argsort(eid, stable=True)
        srt = rows[perm]
        if self.grouped:
            counts = torch.bincount(eid, minlength=self.L)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = torch._grouped_mm(srt, self.w1.transpose(1, 2), offs=offs)
            I = h.shape[1] // 2
            out = torch._grouped_mm(F.silu(h[:, :I]) * h[:, I:], self.w2.transpose(1, 2), offs=offs)
        else:
            parts, lo = [], 0
            for e, c in enumerate(torch.bincount(eid, minlength=self.L).tolist()):  # host sync
                parts.append(reference.expert_ffn(srt[lo:lo + c], self.w1[e], self.w2[e]))
                lo += c
            out = torch.cat(parts)
        return torch.empty_like(out).index_copy(0, perm, out)


def bench(name, n, iters, group):
    R, r = dist.get_world_size(), dist.get_rank()
    p = mokgen.shapes.get(name)
    L = max(p.num_experts // 64, -(-p.topk // R))  # at least top-k experts in all
    shape = mokgen.MoEShape(R * L, p.hidden, p.intermediate, p.topk)
    seed = torch.randint(0, 2**31 - 1, (1,), device="cuda")
    dist.broadcast(seed, 0)
    inp = make_inputs(shape, R, n, seed=int(seed.item()))
    x, z, w1, w2 = (inp[k_][r] for k_ in ("x", "router_logits", "w1", "w2"))
    sw1, sw2 = inp["shared_w1"], inp["shared_w2"]
    dy = torch.randn_like(x)
    layer = mokgen.compile(shape, ep=R, tokens_per_rank=n, group=group)
    leaves = [t.detach().requires_grad_() for t in (x, w1, w2, sw1, sw2)]
    res = dict(shape=name, experts=shape.num_experts, ep=R, tokens=n,
               flops=shape.forward_flops(n))
    res["mokgen_fwd_ms"] = slowest_ms(lambda: layer(x, z, w1, w2, sw1, sw2), iters)

    def train():
        y = layer(leaves[0], z, *leaves[1:])
        y.backward(dy)
    res["mokgen_train_ms"] = slowest_ms(train, iters)
    for label, grouped in (("grouped", True), ("naive", False)):
        base = NcclMoE(shape, R, r, *leaves[1:], grouped=grouped)
        res[f"nccl_{label}_fwd_ms"] = slowest_ms(lambda: base(x, z), iters)
        res[f"nccl_{label}_train_ms"] = slowest_ms(lambda: base(leaves[0], z).backward(dy), iters)
    with torch.no_grad():
        want = NcclMoE(shape, R, r, w1, w2, sw1, sw2)(x, z)
        ours = layer(x, z, w1, w2, sw1, sw2)
    res["err_vs_nccl"] = ((ours.float() - want.float()).norm() / want.float().norm()).item()
    # rows this rank sends to other ranks (dispatch) and gets back (combine), bytes
    experts = reference.route(z, shape.topk)[0]
    off = (experts // L != r).sum().float()
    dist.all_reduce(off, op=dist.ReduceOp.MAX)
    bytes_off = 2 * off.item() * shape.hidden * 2
    res["offrank_bytes"] = bytes_off
    res["floor_fwd_ms"] = 1e3 * max(res["flops"] / PEAK_FLOPS, bytes_off / NVLINK_BPS)
    res["floor_train_ms"] = 1e3 * max(3 * res["flops"] / PEAK_FLOPS, 2 * bytes_off / NVLINK_BPS)
    res["nvlink_gbps_fwd"] = bytes_off / res["mokgen_fwd_ms"] / 1e6
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="kimi-k2.7,glm-5.2,qwen3.5-397b-a17b,deepseek-v4-pro")
    ap.add_argument("--tokens", default="1024,2048,4096")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    for k, v in (("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NCCL_NVLS_ENABLE", "0"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rows = []
    for name in args.shapes.split(","):
        for n in [int(v) for v in args.tokens.split(",")]:
            rows.append(bench(name, n, args.iters, dist.group.WORLD))
            if dist.get_rank() == 0:
                print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        R = dist.get_world_size()
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"moe_layer_multigpu_ep{R}.json"), "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), world=R, rows=rows), f, indent=1)
        print(f"{'shape':<18}{'E':>4}{'ep':>3}{'N':>6}  fwd TFLOP/s: mokgen nccl+grouped "
              f"nccl+naive floor | train TFLOP/s: mokgen nccl+grouped floor | NVLink GB/s")
        for r in rows:
            f, t = r["flops"], 3 * r["flops"]
            print(f"{r['shape']:<18}{r['experts']:>4}{r['ep']:>3}{r['tokens']:>6}  "
                  f"{f / r['mokgen_fwd_ms'] / 1e9:6.0f} {f / r['nccl_grouped_fwd_ms'] / 1e9:6.0f} "
                  f"{f / r['nccl_naive_fwd_ms'] / 1e9:6.0f} {f / r['floor_fwd_ms'] / 1e9:6.0f} | "
                  f"{t / r['mokgen_train_ms'] / 1e9:6.0f} {t / r['nccl_grouped_train_ms'] / 1e9:6.0f} "
                  f"{t / r['floor_train_ms'] / 1e9:6.0f} | {r['nvlink_gbps_fwd']:6.0f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
