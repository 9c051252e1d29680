"""Multicast pairs (GemmConfig.pair: the forward in 2-CTA clusters, gemm_tile.cuh
produce_pairs) on the GPU (marked gpu): layers whose forward runs them, against the reference,
repeated bitwise, and bitwise equal to the default forward: a pair's tiles are the default's
tiles (the same wgmma chains in the same K order, the same epilogues); only who loads which
half of a gate/up tile's weight slice differs. Shapes: the pairs' edges: odd row-tile
counts and pads (a pair's two tasks of different K), row tiles of two experts in one pair,
the shared expert's gate/up pairs, column edge tiles, virtual ranks and the ring's replay."""
import pytest

import mokgen

from test_gpu_pingpong import run_both

pytestmark = pytest.mark.gpu
PAIR = (128, 256, 4, False, False, False, True)


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
