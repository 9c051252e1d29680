"""The workspace's lifecycle on the host (CPU): the buffers a forward runtime and its backward
pass hold, released between calls by one real rank and taken again by the next call. The
runtimes are built by their own constructors on CPU buffers over a stand-in driver
(tests/dry_driver.py); their GPU twins are test_gpu_memory's."""
import gc

import pytest
from dry_driver import DryDriver

import mokgen
from mokgen.compiler.lower import layer_spec
from mokgen.pytorch.api import memory_report

SHAPE = mokgen.shapes.get("gpu-small")


def runtimes(monkeypatch, plan):
    """The plan's ForwardRuntime and BackwardPass, built on CPU buffers (tests/dry_driver.py)."""
    return DryDriver(monkeypatch, layer_spec(plan)).runtimes()


@pytest.mark.parametrize("overrides", [{}, {"reverse_dispatch": "push"}])
def test_release_returns_every_buffer_and_the_next_call_takes_them_again(monkeypatch,
                                                                        overrides):
    """After release nothing of the workspace is referenced by the runtime (the memory goes
    back to the allocator: weak references die, with the collector off, as torchtitan's trainer
    keeps it between its collections), the backward's scratch included; the next
    access makes a workspace of the same bytes, the plan's report less the staging one rank
    does without, with a backward scratch that views the new combine rows where the dx rows
    stay in the dy ring."""
    import weakref

    plan = mokgen.plan(SHAPE, ep=1, tokens_per_rank=256, **overrides)
    spec = layer_spec(plan)
    rt, bwd = runtimes(monkeypatch, plan)
    scratch = bwd.scratch[0]
    if spec.dx_ring:
        assert scratch.ring_dy.untyped_storage().data_ptr() == \
            rt.ranks[0].combine.untyped_storage().data_ptr()
    held = rt.held_bytes()
    report = memory_report(plan)["workspace"]
    staged = 2 * spec.tokens_per_rank * spec.hidden * 2  # x and dy: real ranks stage them
    assert held == report["total"] - staged
    refs = [weakref.ref(t) for t in (rt.ranks[0].ring_a, rt.peers.bufs["combine"][0],
                                     scratch.dw_part)]
    generation = rt.generation
    rt.saved = True
    del scratch
    gc.disable()  # freed by reference counts at once, not by a later collection (a cycle)
    try:
        rt.release()
        assert all(r() is None for r in refs), "a workspace buffer outlived the release"
    finally:
        gc.enable()
    assert rt.held_bytes() == 0 and rt.call_bytes == held
    assert not rt.saved and rt.generation == generation + 1  # a backward now replays
    again = bwd.scratch[0]  # a backward's first access takes the whole workspace again
    assert rt.held_bytes() == held
    if spec.dx_ring:
        assert again.ring_dy.untyped_storage().data_ptr() == \
            rt.ranks[0].combine.untyped_storage().data_ptr()


def test_a_released_workspace_comes_back_poisoned(monkeypatch):
    """poison() holds for workspaces made after it: a test still sees unwritten elements
    in a call after a release."""
    rt, bwd = runtimes(monkeypatch, mokgen.plan(SHAPE, ep=1, tokens_per_rank=256))
    rt.poison()
    bwd.poison()
    rt.release()
    b, sc = rt.ranks[0], bwd.scratch[0]
    assert b.ring_a.isnan().all() and b.combine.isnan().all() and (b.table == -2).all()
    assert sc.dw_part.isnan().all() and b.dweight.isnan().all()


def test_real_ranks_keep_their_symmetric_memory(monkeypatch):
    """Only a workspace this process allocated alone is released: real ranks' peer buffers
    were made together (symmetric memory) and stay."""
    rt, _ = runtimes(monkeypatch, mokgen.plan(SHAPE, ep=1, tokens_per_rank=256))
    rt._workspace["peers"].virtual = False  # as a real rank's PeerSet
    held = rt.held_bytes()
    rt.release()
    assert rt.held_bytes() == held and rt._workspace is not None


def test_only_one_real_rank_releases():
    """CompiledMoE releases where it is one real rank; virtual ranks keep their buffers
    (tests and benchmarks read them after a call), as do real ranks of ep > 1."""
    from mokgen.pytorch.api import CompiledMoE

    one = mokgen.plan(SHAPE, ep=1, tokens_per_rank=256)
    four = mokgen.plan(SHAPE, ep=4, tokens_per_rank=256)
    assert CompiledMoE(one, {}, virtual=False, build_seconds=0).releases_workspace
    assert not CompiledMoE(one, {}, virtual=True, build_seconds=0).releases_workspace
    assert not CompiledMoE(four, {}, virtual=False, build_seconds=0).releases_workspace


def test_module_layers_are_one_real_rank_and_release(monkeypatch):
    """mokgen.MoE and the integrations compile through _LazyKernels: without a process group
    a real one-rank layer, which releases (the kernels stubbed here)."""
    from mokgen.pytorch import api
    from mokgen.pytorch.module import _LazyKernels

    monkeypatch.setattr(api, "compile_layer", lambda plan, virtual=False, group=None:
                        api.CompiledMoE(plan, {}, virtual, 0, group))
    layer = _LazyKernels(mokgen.plan(SHAPE, ep=1, tokens_per_rank=256), None).layer()
    assert not layer.virtual and layer.releases_workspace
