"""Expert parallelism across real GPUs, one process per GPU (marked multigpu):

    torchrun --nproc-per-node=R -m pytest -q -m multigpu tests/test_multigpu.py

Peers come from torch symmetric memory over the EP process group; NVLink multicast stays off.
Every rank builds the same global inputs from one seed (broadcast by rank 0), runs its own
slice and checks it against the reference of the whole layer (every rank's tokens, every
expert). Outside torchrun the tests skip with that command as the reason."""
import os

import pytest
import torch

import mokgen
from mokgen.workloads import cosine, make_inputs, reference_grads, reference_outputs, rel_error

pytestmark = pytest.mark.multigpu
UNDER_TORCHRUN = "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ
if not UNDER_TORCHRUN:
    pytest.skip("run under torchrun: torchrun --nproc-per-node=R -m pytest -m multigpu "
                "tests/test_multigpu.py", allow_module_level=True)

import torch.distributed as dist  # noqa: E402


@pytest.fixture(scope="module")
def group():
    for k, v in (("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NCCL_NVLS_ENABLE", "0"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    yield dist.group.WORLD
    dist.barrier()
    dist.destroy_process_group()


def shared_seed() -> int:
    s = torch.randint(0, 2**31 - 1, (1,), device="cuda")
    dist.broadcast(s, 0)
    return int(s.item())


def global_inputs(shape, R, n, skew=None):
    inputs = make_inputs(shape, R, n, seed=shared_seed(), skew=skew)
    dys = [torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda")
                       .manual_seed(shared_seed() + r)).bfloat16() for r, x in enumerate(inputs["x"])]
    return inputs, dys


def mine(inputs, r):
    return {k: (v[r] if isinstance(v, list) else v) for k, v in inputs.items()}


def run_rank(layer, inputs, dy, r):
    """This rank's forward and backward through autograd: (y, grads of its leaves)."""
    args = mine(inputs, r)
    leaves = {k: v.detach().clone().requires_grad_() for k, v in args.items() if v is not None}
    y = layer(**leaves)
    y.backward(dy)
    return y, {k: v.grad for k, v in leaves.items()}


def check_rank(shape, inputs, dys, y, grads, r):
    ref_y = reference_outputs(shape, inputs)[r]
    assert rel_error(y, ref_y) <= 1e-2, f"rank {r}: y rel {rel_error(y, ref_y):.3e}"
    ref = reference_grads(shape, inputs, dys)
    bad = []
    for k in ("x", "router_logits", "w1", "w2"):
        c, e = cosine(grads[k], ref[k][r]), rel_error(grads[k], ref[k][r])
        if not (c >= 0.9999 and e <= 2e-2):
            bad.append(f"{k}: cosine {c:.6f} rel {e:.3e}")
    for k in ("shared_w1", "shared_w2"):  # each rank: its own tokens; the sum is the layer's
        if ref[k] is None:
            continue
        total = grads[k].float().clone()
        dist.all_reduce(total)
        c, e = cosine(total, ref[k]), rel_error(total, ref[k])
        if not (c >= 0.9999 and e <= 2e-2):
            bad.append(f"{k} (summed over ranks): cosine {c:.6f} rel {e:.3e}")
    assert not bad, f"rank {r}: " + "; ".join(bad)


@pytest.mark.parametrize("skew", [None, "one-soft"])
def test_forward_backward_match_the_reference(group, skew):
    R, r = dist.get_world_size(), dist.get_rank()
    shape, n = mokgen.shapes.get("gpu-small"), 513
    layer = mokgen.compile(shape, ep=R, tokens_per_rank=n, group=group)
    inputs, dys = global_inputs(shape, R, n, skew)
    layer.runtime().poison()
    y, grads = run_rank(layer, inputs, dys[r], r)
    layer.synchronize()
    check_rank(shape, inputs, dys, y, grads, r)


def test_bitwise_identical_over_calls(group):
    R, r = dist.get_world_size(), dist.get_rank()
    shape, n = mokgen.shapes.get("gpu-small"), 700
    layer = mokgen.compile(shape, ep=R, tokens_per_rank=n, group=group)
    inputs, dys = global_inputs(shape, R, n)
    y1, g1 = run_rank(layer, inputs, dys[r], r)
    y2, g2 = run_rank(layer, inputs, dys[r], r)
    layer.synchronize()
    assert torch.equal(y1, y2)
    for k in g1:
        assert torch.equal(g1[k], g2[k]), k


def gather_group(max_ctas: int):
    """A process group for the side collective whose NCCL kernels use at most `max_ctas`
    CTAs (the SMs the layer leaves free), as an FSDP setup would configure its own."""
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.max_ctas = max_ctas
    return dist.new_group(list(range(dist.get_world_size())), pg_options=opts)


def test_reserved_sms_let_a_side_all_gather_run_beside_the_layer(group):
    """reserve_sms: the megakernels launch the plan's CTA count, an all_gather_into_tensor
    issued on a side stream right before each call runs beside them: no watchdog, outputs
    and gradients bitwise those of the calls without it, the gather's result right."""
    R, r = dist.get_world_size(), dist.get_rank()
    if R < 2:
        pytest.skip("needs at least 2 ranks")
    shape, n, reserve = mokgen.shapes.get("gpu-small"), 700, 16
    layer = mokgen.compile(shape, ep=R, tokens_per_rank=n, group=group, reserve_sms=reserve)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    assert layer.plan.num_sms == 132 - reserve
    assert layer.runtime().fwd_ctas == layer.plan.num_sms <= sms
    inputs, dys = global_inputs(shape, R, n)
    y0, g0 = run_rank(layer, inputs, dys[r], r)
    layer.synchronize()
    side, gg = torch.cuda.Stream(), gather_group(reserve)
    numel = 32 << 20  # 64 MiB of bf16 per rank
    shards = [torch.full((numel,), float(c + 1), dtype=torch.bfloat16, device="cuda")
              for c in range(R)]
    for _ in range(3):
        full = torch.empty(R * numel, dtype=torch.bfloat16, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_gather_into_tensor(full, shards[r], group=gg)
        y1, g1 = run_rank(layer, inputs, dys[r], r)
        torch.cuda.current_stream().wait_stream(side)
        layer.synchronize()  # raises the watchdog's record, if any
        assert torch.equal(y0, y1)
        for k in g0:
            assert torch.equal(g0[k], g1[k]), k
        assert torch.equal(full.view(R, numel), torch.stack(shards))
    dist.barrier()
    dist.destroy_process_group(gg)


def test_a_peer_that_never_arrives_raises_on_the_others(group):
    R, r = dist.get_world_size(), dist.get_rank()
    if R < 2:
        pytest.skip("needs at least 2 ranks")
    shape, n = mokgen.shapes.get("gpu-small"), 256
    layer = mokgen.compile(shape, ep=R, tokens_per_rank=n, group=group, watchdog_s=1.0)
    inputs, _ = global_inputs(shape, R, n)
    args = mine(inputs, r)
    layer.runtime()  # the symmetric-memory rendezvous is collective: every rank sets up
    if r == R - 1:  # then this rank "dies": it never calls the layer
        dist.barrier()
        return
    with pytest.raises(RuntimeError, match="watchdog"):
        layer(**args)
        layer.synchronize()
    dist.barrier()

