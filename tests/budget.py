"""The CPU suite's time budget: `python -m pytest -q` from a fresh clone with a cold kernel
cache passes in about 10 minutes on a 2-core machine, and stays so as tests are added.

What is counted is CPU seconds, per test file: the test process's own and its children's
(nvcc and ptxas through ninja, torchrun's ranks, pip), over the setup, call and teardown of
each test that is not a GPU test. CPU seconds add up whatever the parallelism and move much
less with the machine's load than wall seconds: on 2 idle cores the suite's wall time is about
its CPU total / 2 plus the workers' start (~15 s).

Two limits, checked at the end of every run that is not on a GPU machine:
- BUDGET[file] (DEFAULT for a file not named): a file over its budget fails the run.
- TOTAL: all files together; 1400 CPU seconds are ~12 minutes on 2 cores (a cold run of
  1021 took 9 minutes).
A file's budget is about 1.4-1.6x what it used on an idle 2-core machine when it was set
(the numbers in the comments): CPU seconds grow some 15% on a loaded machine (a run beside
others' used 701 where an idle one used 611), and they differ from one machine to the next:
the nvcc-heavy files used 1.5-2.3x their first numbers on a later machine, where two plans'
kernels built at this code took less CPU than at the code that first set them. CI's machine
uses ~1.2x this one's CPU seconds on the same files, and its kernel cache is warm except
after a kernel change (then every file builds cold there). So a regression of half again,
not noise, trips it.

Adding a slow test: share kernels with the tests that already build them (the kernel cache is
keyed by source, so the same plan builds once per run), build only the units the test reads,
and raise the file's line here with what it now uses. MOKGEN_TEST_BUDGET=warn reports without
failing (a slower machine), =off skips the check. The whole table prints with -v or
--durations=N, or when a limit is passed.
"""
from __future__ import annotations

import os
import resource
from collections import defaultdict

import pytest

# CPU seconds per file; in the comment, what it used on an idle 2-core machine (cold cache)
BUDGET = {
    "test_codegen.py": 800,          # 570: presets, widths, fp8, pairs, x window, keep_h
    "test_compile_shapes.py": 420,   # 287: every public model's preset, sampled shapes
    "test_hardware.py": 80,          # 50: presets for 78 and 114 SMs
    "test_example_fsdp.py": 40,      # 24: two torchrun launches of examples/04, one layer
    "test_wheel.py": 35,             # 21: pip wheel, a venv, one cold compile
    "test_torchtitan.py": 34,        # 22-25 (13 on an earlier machine): torchtitan, compile
    "test_examples.py": 28,          # 18: four examples' processes, one cold compile
    "test_host_paths.py": 28,        # 18: host sides of seven plans and five layers (fp8 on CPU)
}
DEFAULT = 15
TOTAL = 1400


def cpu_seconds() -> float:
    """This process's CPU time and its waited-for children's (and theirs, recursively)."""
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _on_gpu(report) -> bool:
    return "gpu" in report.keywords or "multigpu" in report.keywords


class Budget:
    """Measures each test phase's CPU seconds where the test runs (an xdist worker or this
    process) and hands them to the reports, which reach the controlling process; there they
    add up per file and are checked at the end."""

    def __init__(self, config):
        self.config = config
        self.mode = os.environ.get("MOKGEN_TEST_BUDGET", "fail")
        self.cpu = defaultdict(float)
        self.wall = defaultdict(float)
        self._start = None

    # -- where the test runs
    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item):
        self._start = cpu_seconds()
        yield

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item):
        self._start = cpu_seconds()
        yield

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item):
        self._start = cpu_seconds()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        if self._start is not None:
            report.user_properties.append(("cpu_s", cpu_seconds() - self._start))
            self._start = None

    # -- where the reports are gathered (the controlling process)
    def pytest_runtest_logreport(self, report):
        if hasattr(self.config, "workerinput") or _on_gpu(report):
            return
        f = report.nodeid.split("::")[0].rpartition("/")[2]
        self.cpu[f] += dict(report.user_properties).get("cpu_s", 0.0)
        self.wall[f] += report.duration

    def over(self) -> list[str]:
        out = [f"{f}: {self.cpu[f]:.0f} CPU s, budget {BUDGET.get(f, DEFAULT)}"
               for f in self.cpu if self.cpu[f] > BUDGET.get(f, DEFAULT)]
        total = sum(self.cpu.values())
        if total > TOTAL:
            out.append(f"all files: {total:.0f} CPU s, budget {TOTAL}")
        return out

    def pytest_sessionfinish(self, session):
        if (self.mode == "fail" and not hasattr(self.config, "workerinput")
                and self.over() and session.exitstatus == 0):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.mode == "off" or not self.cpu or hasattr(self.config, "workerinput"):
            return
        tr, over = terminalreporter, self.over()
        total = sum(self.cpu.values())
        top = sorted(self.cpu, key=self.cpu.get, reverse=True)
        tr.write_line(f"test time: {total:.0f} CPU s of {TOTAL} (tests/budget.py); most: "
                      + ", ".join(f"{f} {self.cpu[f]:.0f}" for f in top[:3]))
        if over or self.config.getoption("verbose") > 0 or self.config.getoption("durations"):
            tr.write_sep("=", "CPU seconds per test file (budget: tests/budget.py)")
            for f in top:
                b = BUDGET.get(f, DEFAULT)
                flag = "  OVER BUDGET" if self.cpu[f] > b else ""
                tr.write_line(f"{self.cpu[f]:8.1f} CPU s {self.wall[f]:8.1f} s  "
                              f"budget {b:5}  {f}{flag}")
        for line in over:
            tr.write_line(f"OVER THE TIME BUDGET: {line}"
                          + (" (MOKGEN_TEST_BUDGET=warn: not failing)"
                             if self.mode == "warn" else ""), red=True, bold=True)
