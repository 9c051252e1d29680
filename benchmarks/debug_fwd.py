"""Debug aid: run one forward stage by stage with a sync after each kernel, then check the
schedule table. Usage: python benchmarks/debug_fwd.py SHAPE EP TOKENS [minibatch macrobatch]"""
import sys

import torch

sys.path.insert(0, ".")
import mokgen  # noqa: E402
from mokgen.harness.workloads import make_inputs, reference_outputs, rel_error  # noqa: E402

name, ep, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ov = dict(minibatch=int(sys.argv[4]), macrobatch=int(sys.argv[5])) if len(sys.argv) > 5 else {}
skew = sys.argv[6] if len(sys.argv) > 6 else None
shape = mokgen.shapes.get(name)
layer = mokgen.compile(shape, ep=ep, tokens_per_rank=n, virtual=True, **ov)
print(layer.plan.minibatch, layer.plan.macrobatch, layer.plan.comm_sms_fwd)
inp = make_inputs(shape, ep, n, skew=skew)
rt = layer.runtime()
rt.poison()
zs = [z.float().contiguous() for z in inp["router_logits"]]
for b in rt.ranks:
    b.counters.zero_()
for i in range(ep):
    rt.route(i, zs[i], n)
torch.cuda.synchronize()
print("route ok")
xp = rt.peers.x_pointers(inp["x"])
for i in range(ep):
    rt.schedule(i, n)
    torch.cuda.synchronize()
    b = rt.ranks[i]
    rows = int(b.meta[0])
    t = b.table[:rows]
    real = t[:, 0] >= 0
    key = t[real, 0].long() * n * shape.topk + t[real, 1].long()
    print(f"rank {i}: rows {rows} real {int(real.sum())} unique {len(key.unique())} "
          f"bad {int((t[:, 0] < -1).sum())} offsets {b.offsets.tolist()[:8]}")
    from mokgen.schedule import dispatch_schedule
    L = shape.num_experts // ep
    ref_s = dispatch_schedule(b.routes[:, : n * shape.topk].long(), i, L)
    same_routes = all(torch.equal(b.routes, o.routes) for o in rt.ranks)
    M = b.counts.view(ep, L).long().sum(0)
    print("  routes identical across ranks", same_routes, "counts ok",
          torch.equal(M, ref_s.counts), M.tolist(), ref_s.counts.tolist())
    pos = ref_s.padded_positions(128)
    want = torch.full_like(t, -1)
    want[pos] = ref_s.table.int()
    bad = (t != want).any(1).nonzero().squeeze(1)
    print("  mismatching rows", len(bad), bad[:10].tolist(),
          [t[k].tolist() for k in bad[:5]], [want[k].tolist() for k in bad[:5]])
    rt.experts(i, inp["x"][i], xp, inp["w1"][i], inp["w2"][i], inp["shared_w1"], inp["shared_w2"])
    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print("megakernel failed on rank", i, e)
        raise
    print("counters", b.counters[:12].tolist(), "device checks", rt.device_check())
ys = [rt.combine_sum(i, n) for i in range(ep)]
ref = reference_outputs(shape, inp)
print("errors", [round(rel_error(y, r), 5) for y, r in zip(ys, ref)])
