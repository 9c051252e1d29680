"""benchmarks/peak_phases.py's trace walk (no GPU): the peak between the phase markers, its
phase, and the live blocks there by allocation site, on a synthetic allocator trace."""
import pytest

from benchmark_scripts import load


def _f(name, file="/x/mokgen/runtime/moe.py", line=1):
    return {"filename": file, "line": line, "name": name}


def _trace():
    pp = load("peak_phases")
    mark = [_f(pp.MARK, "/b/benchmarks/peak_phases.py")]
    a = lambda addr, size, frames: {"action": "alloc", "addr": addr, "size": size,  # noqa: E731
                                    "frames": frames}
    free = lambda addr: {"action": "free_requested", "addr": addr, "frames": []}  # noqa: E731
    ws = [_f("make_workspace", line=10), _f("step", "/b/benchmarks/peak_phases.py", 5)]
    return pp, [
        a(1, 1000, ws),                       # the workspace, before the step: counted live
        a(2, 700, [_f("warmup", "/usr/lib/torch/nn.py", 3)]), free(2),
        a(90, 512, mark), free(90),           # marker 0: the forward
        a(3, 300, [_f("forward_out", line=20)]),
        a(4, 200, [_f("scratch", "/s/sonicmoe/functional.py", 7)]),
        free(4),
        a(91, 512, mark), free(91),           # marker 1: the backward
        a(5, 400, [_f("dx", "/usr/lib/torch/autograd.py", 9)]),  # peak: 1000 + 300 + 400
        free(3),
        a(6, 100, [_f("late")]),
        a(92, 512, mark), free(92),           # marker 2: the end
        a(7, 5000, [_f("after")]),            # past the window: not the peak
    ]


def test_walk_finds_the_peak_its_phase_and_sites():
    pp, trace = _trace()
    r = pp.walk(trace, top=2)
    assert r["peak_bytes"] == 1700 and r["phase"] == 1
    assert [s["bytes"] for s in r["sites"]] == [1000, 400]
    assert r["sites"][0]["site"] == "moe.py:10 (make_workspace)"  # mokgen's frame first
    assert r["sites"][1]["site"] == "autograd.py:9 (dx)"  # no library frame: the innermost


def test_walk_needs_two_markers():
    pp, trace = _trace()
    with pytest.raises(ValueError, match="markers"):
        pp.walk([e for e in trace if e.get("addr") not in (91, 92)])
