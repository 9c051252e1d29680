"""How does mokgen compare with DeepEP's dispatch/combine + grouped_mm across GPUs?

    torchrun --nproc-per-node=2 benchmarks/peers_deepep.py [--tokens 2048] [--loads ep64,ep8]
        [--shapes kimi-k2.7,...] [--iters 20] [--out DIR]

(benchmarks/multigpu.py's arguments; --no-naive means nothing here.)

DeepEP (deepseek-ai/DeepEP at the commit in .peers-deepep/COMMIT, its last release before
EPv2, built without NVSHMEM: the intranode kernels, peers over CUDA IPC and NVLink; fetched
and built by the scripts in benchmarks/peers/) moves the rows and torch._grouped_mm runs the
experts: the layer users build from DeepEP's normal (high-throughput) mode. One call:
  route (softmax top-k, mokgen.reference.route) -> get_dispatch_layout -> dispatch (each
  token once per destination rank, its top-k ids made local there, with the route weights;
  the received counts reach the host: DeepEP's own sync) -> the local experts on each
  received (token, local expert) pair (mokgen.harness.ep_baseline's grouped_mm) -> the weighted sum
  per received token -> combine (the sum over ranks) + the shared expert.
The training step is autograd's with DeepEP's adjoints: dispatch's backward combines the rows'
and the weights' gradients, combine's backward dispatches again with the handle.

Loads, inputs and timing are benchmarks/multigpu.py's (slowest rank's median of --iters
CUDA-event-timed calls); mokgen's forward and training step run on the same inputs, and each
row holds the two layers' differences (output, dx, d router_logits). Rows go into
DIR/peers_deepep.json (rows per GPU kind and world size, benchmarks/result_file.py) after
every row.
"""
from __future__ import annotations

import gc
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import mokgen  # noqa: E402
from mokgen import reference  # noqa: E402
from mokgen.harness.ep_baseline import EPBaseline  # noqa: E402
from multigpu import (configs, init_dist, load_shape, meta, parse, rank_inputs,  # noqa: E402
                      slowest_ms, train_step)

import result_file  # noqa: E402

KEY = ("world", "shape", "load", "tokens")


class _Dispatch(torch.autograd.Function):
    """DeepEP's dispatch of x and its route weights -> (received rows, their weights); the
    received local expert ids and the handle go into `got`. Backward: combine the gradients."""

    @staticmethod
    def forward(ctx, x, weights, buf, experts, layout, got):
        per_rank, in_rank, per_expert = layout
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=experts, topk_weights=weights)
        ctx.buf, ctx.handle = buf, handle
        got["idx"], got["handle"] = recv_idx, handle
        return recv_x, recv_w

    @staticmethod
    def backward(ctx, d_rows, d_weights):
        dx, dw, _ = ctx.buf.combine(d_rows.contiguous(), ctx.handle,
                                    topk_weights=d_weights.contiguous())
        return dx, dw, None, None, None, None


class _Combine(torch.autograd.Function):
    """DeepEP's combine (sum over the ranks); backward: dispatch with the same handle."""

    @staticmethod
    def forward(ctx, y, buf, handle):
        ctx.buf, ctx.handle = buf, handle
        return buf.combine(y, handle)[0]

    @staticmethod
    def backward(ctx, dy):
        return ctx.buf.dispatch(dy.contiguous(), handle=ctx.handle)[0], None, None


class DeepEPLayer:
    """One rank of the DeepEP + grouped_mm layer: global experts r*L .. r*L+L-1 as w1, w2
    (leaves that may require grad), the shared expert replicated."""

    def __init__(self, buf, shape, R: int, w1, w2, shared_w1, shared_w2):
        self.buf, self.k, self.E = buf, shape.topk, shape.num_experts
        self.local = EPBaseline(shape, R, w1, w2, shared_w1, shared_w2, exchange=None)
        self.sw1, self.sw2 = shared_w1, shared_w2

    def __call__(self, x, logits):
        experts, weights = reference.route(logits, self.k)
        experts = experts.contiguous()
        per_rank, _, per_expert, in_rank, _ = self.buf.get_dispatch_layout(experts, self.E)
        got = {}
        rows, row_w = _Dispatch.apply(x, weights, self.buf, experts,
                                      (per_rank, in_rank, per_expert), got)
        tok, slot = (got["idx"] >= 0).nonzero(as_tuple=True)
        out = self.local.experts(rows[tok], got["idx"][tok, slot])
        weighted = out.float() * row_w[tok, slot].unsqueeze(-1)
        summed = weighted.new_zeros(rows.shape).index_add(0, tok, weighted).to(x.dtype)
        y = _Combine.apply(summed, self.buf, got["handle"])
        if self.sw1 is not None:
            y = y + reference.expert_ffn(x, self.sw1, self.sw2)
        return y


def deepep_buffer(group, hiddens):
    """One DeepEP buffer for every row: NVLink bytes for the widest hidden size, by DeepEP's
    own hint for its default dispatch and combine configs (Buffer.num_sms SMs)."""
    import deep_ep

    R = group.size()
    cfgs = (deep_ep.Buffer.get_dispatch_config(R), deep_ep.Buffer.get_combine_config(R))
    nvl = max(c.get_nvl_buffer_size_hint(2 * D, R) for c in cfgs for D in hiddens)
    return deep_ep.Buffer(group, nvl, 0, explicitly_destroy=True)


def bench(buf, name, load, n, iters):
    import torch.distributed as dist
    from mokgen.harness.workloads import rel_error

    R = dist.get_world_size()
    shape = load_shape(name, load, R)
    tensors, dy = rank_inputs(shape, n)
    x, z, w1, w2, sw1, sw2 = tensors
    leaves = [t.detach().requires_grad_() for t in tensors]
    layer = mokgen.compile(shape, ep=R, tokens_per_rank=n, group=dist.group.WORLD)
    peer = DeepEPLayer(buf, shape, R, *leaves[2:])
    res = dict(shape=name, load=load, experts=shape.num_experts,
               local_experts=shape.num_experts // R, ep=R, tokens=n, hidden=shape.hidden,
               intermediate=shape.intermediate, topk=shape.topk, flops=shape.forward_flops(n))
    with torch.no_grad():
        res["mokgen_fwd_ms"] = slowest_ms(lambda: layer(x, z, w1, w2, sw1, sw2), iters)
        res["deepep_fwd_ms"] = slowest_ms(lambda: peer(x, z), iters)
    res["mokgen_train_ms"] = slowest_ms(train_step(leaves, dy, layer), iters)
    ours = [leaves[i].grad.clone() for i in (0, 1)]
    res["deepep_train_ms"] = slowest_ms(
        train_step(leaves, dy, lambda x_, z_, *_: peer(x_, z_)), iters)
    with torch.no_grad():
        res["err_vs_deepep"] = rel_error(layer(x, z, w1, w2, sw1, sw2), peer(x, z))
    for i, k in enumerate(("x", "z")):
        res[f"err_d{k}_vs_deepep"] = rel_error(ours[i], leaves[i].grad)
    return res


def deepep_commit() -> str:
    try:
        with open(os.path.join(HERE, "..", ".peers-deepep", "COMMIT")) as f:
            return f.read().strip()
    except OSError:
        return os.environ.get("DEEPEP_COMMIT", "?")


def main(argv=None):
    import torch.distributed as dist

    args = parse(argv, name="peers_deepep", description=__doc__)
    init_dist()
    R, rank = dist.get_world_size(), dist.get_rank()
    try:
        import deep_ep
    except ImportError as e:
        print(f"rank {rank}: deep_ep does not import ({e}); build it with "
              f"benchmarks/peers/build_deepep.sh", flush=True)
        sys.exit(3)
    todo = configs(args.shapes, args.loads, args.tokens, R)
    buf = deepep_buffer(dist.group.WORLD, {load_shape(s, ld, R).hidden for s, ld, _ in todo})
    info = meta(deepep_commit=deepep_commit(), deepep_sms=deep_ep.Buffer.num_sms)
    rows, path = [], None
    for name, load, n in todo:
        rows.append(dict(bench(buf, name, load, n, args.iters), world=R))
        if rank == 0:  # written after every row: a cut-short run keeps its rows
            print(json.dumps(rows[-1]), flush=True)
            path = result_file.write("peers_deepep", rows[-1:], KEY, out=args.out, meta=info)
        gc.collect()
        torch.cuda.empty_cache()
    if rank == 0:
        print(f"wrote {path}")
        print(f"{'shape':<18}{'load':>5}{'N':>6}  fwd ms mokgen DeepEP  x   | "
              f"train ms mokgen DeepEP  x")
        for r in rows:
            print(f"{r['shape']:<18}{r['load']:>5}{r['tokens']:>6}  {r['mokgen_fwd_ms']:13.3f} "
                  f"{r['deepep_fwd_ms']:6.3f} {r['deepep_fwd_ms'] / r['mokgen_fwd_ms']:4.2f} | "
                  f"{r['mokgen_train_ms']:15.3f} {r['deepep_train_ms']:6.3f} "
                  f"{r['deepep_train_ms'] / r['mokgen_train_ms']:4.2f}")
    dist.barrier()
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
