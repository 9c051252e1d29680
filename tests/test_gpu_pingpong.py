"""The ping-pong consumer schedule (GemmConfig.pingpong, gemm_tile.cuh) and the signal warp
(GemmConfig.signal_warp) on the GPU (marked gpu): layers whose forward and backward kernels run
them, against the reference, repeated bitwise, and bitwise equal to the default (cooperative,
consumer-signalled) schedule: each output element is the same warpgroup's wgmma chain in the
same K order in all three, and every epilogue is shared."""
import pytest
import torch

import mokgen
from mokgen.compiler.ir.ops import GemmConfig
from mokgen.compiler.limits import DEFAULT_GEMM
from mokgen.harness.workloads import make_inputs, reference_grads, reference_outputs, rel_error

from test_gpu_backward import check, gemm_test_module, grads_of

pytestmark = pytest.mark.gpu
PP = (128, 256, 4, True)
SW = (128, 256, 4, False, True)


def flat(grads):
    return [(k, i, t) for k, v in grads.items() if v is not None
            for i, t in enumerate(v if isinstance(v, list) else [v])]


def run_both(shape, ep, tokens, dtype="bf16", skew=None, gemm=PP, fwd=True, bwd=True,
             **overrides):
    """The layer of GEMM config `gemm` (ping-pong, the signal warp, multicast pairs) in both
    kernels (fwd False: the backward's only; bwd False: the forward's only): forward and
    backward, twice (bitwise), against the reference (bf16: its tolerances); then the default
    layer on the same inputs: bitwise the same."""
    inputs = make_inputs(shape, ep, tokens, skew=skew)
    dys = [torch.randn_like(x) for x in inputs["x"]]
    want = GemmConfig(*gemm)
    want_fwd, want_bwd = want if fwd else DEFAULT_GEMM, want if bwd else DEFAULT_GEMM
    out = {}
    for name, cfg in (("variant", dict(gemm_fwd=tuple(want_fwd), gemm_bwd=tuple(want_bwd))),
                      ("coop", {})):
        layer = mokgen.compile(shape, ep=ep, tokens_per_rank=tokens, dtype=dtype, virtual=True,
                               **cfg, **overrides)
        assert (layer.plan.gemm_fwd, layer.plan.gemm_bwd) == \
            ((want_fwd, want_bwd) if name == "variant" else (DEFAULT_GEMM, DEFAULT_GEMM))
        layer.runtime().poison()
        with torch.no_grad():
            ys = [y.clone() for y in layer(**inputs)]
        layer.backward_runtime().poison()
        grads = grads_of(layer, inputs, dys)
        again = grads_of(layer, inputs, dys)
        torch.cuda.synchronize()
        layer.synchronize()
        for (k, i, a), (_, _, b) in zip(flat(grads), flat(again)):
            assert torch.equal(a, b), f"{name} {k}[{i}]: not bitwise identical over calls"
        if name == "variant" and dtype == "bf16":
            for r, (y, want) in enumerate(zip(ys, reference_outputs(shape, inputs))):
                assert not y.isnan().any(), f"rank {r}: unwritten (NaN) output elements"
                e = rel_error(y, want)
                assert e <= 1e-2, f"rank {r}: rel. error {e:.3e}"
            check(grads, reference_grads(shape, inputs, dys))
        # copies: the next layer may share this one's workspace
        out[name] = ys, [(k, i, t.clone()) for k, i, t in flat(grads)]
    for r, (a, b) in enumerate(zip(out["variant"][0], out["coop"][0])):
        assert torch.equal(a, b), f"forward rank {r}: {gemm} differs from the default"
    for (k, i, a), (_, _, b) in zip(out["variant"][1], out["coop"][1]):
        assert torch.equal(a, b), f"{k}[{i}]: {gemm} differs from the default"


@pytest.mark.parametrize("ep,tokens", [(1, 1000), (4, 777)])
def test_pingpong_layer(ep, tokens):
    run_both(mokgen.shapes.get("gpu-small"), ep, tokens)


def test_pingpong_ring_replay_and_skew():
    run_both(mokgen.shapes.get("gpu-small"), 4, 900, skew="one-soft", minibatch=128,
             macrobatch=256)


def test_pingpong_preset_dims_and_edge_tiles():
    p = mokgen.shapes.get("kimi-k2.7")
    run_both(mokgen.MoEShape(16, p.hidden, p.intermediate, p.topk), 2, 256)
    # odd multiples of 128 (edge tiles) and a K tail of 16
    run_both(mokgen.MoEShape(8, 1040, 720, 2, shared_intermediate=336), 2, 300)


@pytest.mark.parametrize("dtype", ["fp8", "mxfp8"])
def test_pingpong_fp8_equals_cooperative(dtype):
    run_both(mokgen.shapes.get("gpu-small"), 2, 700, dtype=dtype)


@pytest.mark.parametrize("ep,tokens", [(1, 1000), (4, 777)])
def test_signal_warp_layer(ep, tokens):
    run_both(mokgen.shapes.get("gpu-small"), ep, tokens, gemm=SW)


def test_signal_warp_ring_replay_skew_and_edge_tiles():
    run_both(mokgen.shapes.get("gpu-small"), 4, 900, skew="one-soft", minibatch=128,
             macrobatch=256, gemm=SW)
    run_both(mokgen.MoEShape(8, 1040, 720, 2, shared_intermediate=336), 2, 300, gemm=SW)


@pytest.mark.parametrize("dtype", ["fp8", "mxfp8"])
def test_signal_warp_fp8_equals_cooperative(dtype):
    # limits: the MXFP8 forward refuses it (spills)
    run_both(mokgen.shapes.get("gpu-small"), 2, 700, dtype=dtype, gemm=SW, fwd=dtype == "fp8")


@pytest.mark.parametrize("trans", [0, 1, 2])
def test_pingpong_engine_alone(tmp_path, trans):
    """gemm_test.cu's plain kernels in both schedules: C = A B^T with K-major operands (0), B
    MN-major (1), both (2); an edge tile (N = 384) and a K tail (K = 200)."""
    from mokgen.runtime import cuda as mc

    mod, smem = gemm_test_module(tmp_path)
    M, N, K = 1000, 384, 200
    A = torch.randn(M, K, device="cuda").bfloat16()
    B = torch.randn(N, K, device="cuda").bfloat16()
    At, Bt = A.T.contiguous(), B.T.contiguous()
    ta = (mc.make_tensor_map_2d(At, K, M, M * 2, 64, 64) if trans == 2
          else mc.make_tensor_map_2d(A, M, K, K * 2, 128, 64))
    tb = (mc.make_tensor_map_2d(Bt, K, N, N * 2, 64, 64) if trans
          else mc.make_tensor_map_2d(B, N, K, K * 2, 256, 64))
    ref = A.float() @ B.float().T
    outs = []
    for suffix in ("", "_pp", "_pp"):
        f = mod.function(("gemm_plain_t" if trans else "gemm_plain") + suffix, smem)
        C = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        args = [ta, tb, C, M, N, K, N, counter] + ([trans] if trans else [])
        mc.launch(f, 8, 384, smem, None, args)
        torch.cuda.synchronize()
        assert rel_error(C, ref) <= 1e-2, suffix
        outs.append(C)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
