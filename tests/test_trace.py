"""benchmarks/trace.py's arithmetic on hand-made records."""
from benchmark_scripts import load
from mokgen.runtime import abi


def _rec(op, kb, ask, got, pop, main, epi, done, ns, fill_wait=0, fill_issue=0, full_wait=0):
    r = [0] * abi.TRACE_WORDS
    vals = dict(kTrOp=op | (kb << 32), kTrAsk=ask, kTrGot=got, kTrPop=pop, kTrMain=main,
                kTrEpi=epi, kTrDone=done, kTrGlobalNs=ns, kTrFillWait=fill_wait,
                kTrFillIssue=fill_issue, kTrFullWait=full_wait)
    for i, f in enumerate(abi.TRACE_FIELDS):
        r[i] = vals[f]
    return r


def test_summarize_sums_phases_per_kind():
    t = load("trace")
    dg, dx = abi.BWD_OPS["kDgrad"], abi.BWD_OPS["kDx"] | (1 << 8)  # an operand bit too
    # one CTA, clock = 2 cycles per ns (ns_per_clk 0.5); unrecorded rows are zero
    cta = [_rec(dg, 80, 100, 110, 200, 1200, 1400, 1500, 1000, 300, 40, 600),
           _rec(dx, 256, 1500, 1600, 2000, 9000, 9100, 9200, 1900),
           [0] * abi.TRACE_WORDS]
    s = t.summarize([cta], abi.BWD_OPS, 128, 256)
    d, x = s["kinds"]["Dgrad"], s["kinds"]["Dx"]
    ms = 0.5 / 1e6
    assert d["tasks"] == 1 and x["tasks"] == 1
    assert abs(d["mainloop_ms"] - 1000 * ms) < 1e-12 and abs(d["epilogue_ms"] - 200 * ms) < 1e-12
    assert abs(d["idle_ms"] - 100 * ms) < 1e-12  # from the first ask to the first pop
    assert abs(x["idle_ms"] - 500 * ms) < 1e-12  # the previous done to this pop
    assert abs(x["signal_ms"] - 100 * ms) < 1e-12 and x["mean_k_blocks"] == 256
    assert abs(d["flops"] - 2.0 * 128 * 256 * 64 * 80) < 1
    # the ring's sums: clocks as durations (0.5 ns a clock), per task
    assert abs(d["mean_fill_wait_us"] - 300 * 0.5 / 1e3) < 1e-12
    assert abs(d["mean_fill_issue_us"] - 40 * 0.5 / 1e3) < 1e-12
    assert abs(d["mean_full_wait_us"] - 600 * 0.5 / 1e3) < 1e-12 and x["mean_full_wait_us"] == 0
    # per SM clock, whatever the clock: 1000 clocks of mainloop
    assert abs(d["mainloop_flop_per_clk"] - 2.0 * 128 * 256 * 64 * 80 / 1000) < 1e-6
    assert abs(s["span_ms"] - (1900 + 7200 * 0.5 - (1000 - 50)) / 1e6) < 1e-12
    assert 0 < max(s["bins_mainloop"]) <= 1.0
    # the start: the CTA's first mainloop 50 ns after its first ask (100 clocks of waiting in
    # the ask -> pop gap, 10 of them in the producer's next_task)
    st = s["start"]
    assert st["first_kinds"] == {"Dgrad": 1}
    assert abs(st["first_main_us_median"] - 50 / 1e3) < 1e-9
    assert abs(st["first_wait_us_median"] - 10 * 0.5 / 1e3) < 1e-9
    assert "start: first mainloop at" in t.table("backward", s)


def test_plan_overrides_are_typed_as_the_plan_takes_them():
    # trace.py --plan and ncu_step.py's KEY=VALUE: integers as ints, names as strings
    t = load("trace")
    assert t.overrides(["dispatch=gather", "comm_sms_bwd=4", "minibatch=-1"]) == \
        {"dispatch": "gather", "comm_sms_bwd": 4, "minibatch": -1}
    assert t.overrides([]) == {}


def test_clocks_reports_the_settled_time_a_call(monkeypatch):
    """trace.clocks with a fake nvidia-smi and a fake wall clock: each call takes 10 ms, so the
    sustained time a call is 10 ms whatever the samples; the samples inside each phase's
    settled span give its clock and power."""
    import datetime
    t = load("trace")
    now = [1_000_000.0]

    class Smi:  # what nvidia-smi -lms printed over the run: a 600 MHz / 650 W sample every 0.1 s
        def __init__(self, *a, **k):
            pass

        def terminate(self):
            pass

        def communicate(self):
            lines = []
            for i in range(int((now[0] - 1_000_000.0) / 0.1) + 1):
                ts = datetime.datetime.fromtimestamp(1_000_000.0 + 0.1 * i)
                lines.append(f"{ts:%Y/%m/%d %H:%M:%S.%f}, 600, 650.5, 700.00, 0x4")
            return "\n".join(lines), ""

    def call():
        now[0] += 0.010

    monkeypatch.setattr(t.subprocess, "Popen", Smi)
    monkeypatch.setattr(t.time, "time", lambda: now[0])
    monkeypatch.setattr(t.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    monkeypatch.setattr(t.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(t.torch.cuda, "current_device", lambda: 0)
    out = t.clocks([("a", call), ("b", call)], seconds=1.0)
    for name in ("a", "b"):
        assert abs(out[name]["ms"] - 10.0) < 1e-6
        assert out[name]["mhz"] == 600 and out[name]["watts"] == 650.5
        assert out[name]["power_capped"] == 1.0 and out[name]["samples"] >= 7


def test_sustained_ms_refuses_a_window_with_no_call(monkeypatch):
    """A call longer than the whole run leaves nothing after the settling time: an error, not
    a rate made up from the settling calls."""
    import pytest
    from mokgen.harness import bench
    now = [0.0]

    def call():
        now[0] += 1.0

    monkeypatch.setattr(bench.time, "time", lambda: now[0])
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    with pytest.raises(ValueError):
        bench.sustained_ms(call, seconds=0.5, batch=1)
    now[0] = 0.0
    assert abs(bench.sustained_ms(lambda: now.__setitem__(0, now[0] + 0.01), 1.0) - 10.0) < 1e-6
