"""Multicast pairs (GemmConfig.pair: the forward in 2-CTA clusters, gemm_tile.cuh
produce_pairs) on the GPU (marked gpu): layers whose forward runs them, against the reference,
repeated bitwise, and bitwise equal to the default forward: a pair's tiles are the default's
tiles (the same wgmma chains in the same K order, the same epilogues); only who loads which
half of a gate/up tile's weight slice differs. Shapes: the pairs' edges: odd row-tile
counts and pads (a pair's two tasks of different K), row tiles of two experts in one pair,
the shared expert's gate/up pairs, column edge tiles, virtual ranks and the ring's replay."""
import pytest
import torch

import mokgen
from mokgen.compiler.ir.ops import GemmConfig
from mokgen.compiler.limits import DEFAULT_GEMM
from mokgen.harness.workloads import make_inputs, reference_grads, reference_outputs, rel_error

from test_gpu_backward import check, grads_of

pytestmark = pytest.mark.gpu
PAIR = (128, 256, 4, True)


def flat(grads):
    return [(k, i, t) for k, v in grads.items() if v is not None
            for i, t in enumerate(v if isinstance(v, list) else [v])]


def run_both(shape, ep, tokens, dtype="bf16", skew=None, gemm=PAIR, fwd=True, bwd=True,
             **overrides):
    """The layer of GEMM config `gemm` in both kernels (fwd False: the backward's only; bwd
    False: the forward's only): forward and backward, twice (bitwise), against the reference
    (bf16: its tolerances); then the default layer on the same inputs: bitwise the same."""
    want = GemmConfig(*gemm)
    want_fwd, want_bwd = want if fwd else DEFAULT_GEMM, want if bwd else DEFAULT_GEMM
    # both layers planned before any CUDA tensor (benchmarks/prebuild.py collect packs both)
    cfgs = {"variant": dict(gemm_fwd=tuple(want_fwd), gemm_bwd=tuple(want_bwd)), "coop": {}}
    for cfg in cfgs.values():
        mokgen.plan(shape, ep=ep, tokens_per_rank=tokens, dtype=dtype, **cfg, **overrides)
    inputs = make_inputs(shape, ep, tokens, skew=skew)
    dys = [torch.randn_like(x) for x in inputs["x"]]
    out = {}
    for name, cfg in cfgs.items():
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
def test_pair_layer(ep, tokens):
    run_both(mokgen.shapes.get("gpu-small"), ep, tokens, gemm=PAIR, bwd=False)


def test_pair_ring_replay_and_skew():
    run_both(mokgen.shapes.get("gpu-small"), 4, 900, skew="one-soft", minibatch=128,
             macrobatch=256, gemm=PAIR, bwd=False)


def test_pair_edge_tiles_and_shared_expert():
    # odd multiples of 128 (edge tiles), a K tail of 16, a shared expert (its gate/up pairs)
    run_both(mokgen.MoEShape(8, 1040, 720, 2, shared_intermediate=336), 2, 300, gemm=PAIR,
             bwd=False)
    # few large experts at one rank: long runs of multicast pairs, the pads at block ends
    run_both(mokgen.MoEShape(4, 1024, 1536, 2), 1, 1100, gemm=PAIR, bwd=False)
