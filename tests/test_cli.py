"""The command line as a user meets it: every command and option has help, --version, shape
names in any case with a suggestion, and a closed pipe ends it quietly. No GPU."""
import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import mokgen
from mokgen import cli

ROOT = Path(__file__).parents[1]
COMMANDS = ("plan", "compile", "bench", "tune", "simulate")


def _parsers(parser: argparse.ArgumentParser, path=("mokgen",)):
    """(path, parser) of the parser and of every subcommand's parser below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def _help(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_command_with_its_line(capsys):
    out = _help(capsys, ["--help"])
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("    ")
              and not line.startswith("     ")]
    assert listed == list(COMMANDS), out
    (sub,) = [a for a in cli.build_parser()._actions
              if isinstance(a, argparse._SubParsersAction)]
    assert [c.dest for c in sub._choices_actions] == list(COMMANDS)
    for choice in sub._choices_actions:
        assert choice.help and choice.help.split()[0] in out, choice.dest


def test_every_option_of_every_command_has_help():
    parsers = dict(_parsers(cli.build_parser()))
    assert {p[1:] for p in parsers} == {()} | {(c,) for c in COMMANDS}
    missing = [(" ".join(path), a.option_strings or a.dest) for path, p in parsers.items()
               for a in p._actions if not isinstance(a, argparse._SubParsersAction)
               and (not a.help or a.help == argparse.SUPPRESS)]
    assert missing == []
    for command in cli.TOOLS:  # each harness command brings its options, not an empty parser
        assert len(parsers[("mokgen", command)]._actions) > 3, command


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_its_own_help(capsys, command):
    out = _help(capsys, [command, "--help"])
    assert out.startswith("usage: ") and f" {command} " in out.splitlines()[0]
    assert "--shape" in out


def test_version(capsys):
    assert _help(capsys, ["--version"]) == f"mokgen {mokgen.__version__}\n"


def test_shape_names_in_any_case_with_a_suggestion(capsys):
    assert mokgen.shapes.get("Qwen3-30B-A3B") is mokgen.shapes.get("qwen3-30b-a3b")
    assert mokgen.shapes.get("KIMI-K2.7").name == "kimi-k2.7"
    with pytest.raises(ValueError, match=r"unknown shape preset 'Kimi-K2' \(did you mean "
                                         r"'kimi-k2.7'\?\); known: kimi-k2.7, "):
        mokgen.shapes.get("Kimi-K2")
    with pytest.raises(ValueError, match=r"unknown shape preset 'zzz'; known: kimi-k2.7"):
        mokgen.shapes.get("zzz")
    with pytest.raises(TypeError, match="str"):
        mokgen.shapes.get(None)
    assert cli.main(["plan", "--shape", "Mixtral-8x7B", "--ep", "1", "--tokens", "256"]) == 0
    assert "mixtral-8x7b" in capsys.readouterr().out
    assert cli.main(["plan", "--shape", "mixtral-8x7", "--ep", "1"]) == 2
    assert "did you mean 'mixtral-8x7b'" in capsys.readouterr().err
    assert cli.main(["simulate", "--shape", "GLM-5.2", "--ep", "8"]) == 0
    assert capsys.readouterr().out.startswith("glm-5.2, ")


def test_the_memory_options_are_flags_too(capsys):
    """The exchanges' one-rank options and the ring's budget reach the plan from the command
    line; a direction the kernels lack is refused by argparse, naming the allowed ones."""
    argv = ["plan", "--shape", "qwen3-30b-a3b", "--ep", "1", "--tokens", "8192", "--json"]
    assert cli.main(argv + ["--dispatch", "gather", "--reverse-combine", "pull",
                            "--x-slots", "6"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert (p["dispatch"], p["reverse_combine"], p["x_slots"]) == ("gather", "pull", 6)
    assert cli.main(argv + ["--ring-budget-bytes", str(2**28)]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["ring_budget_bytes"] == 2**28 and p["ring_bytes"] <= 2**28
    with pytest.raises(SystemExit):
        cli.main(argv + ["--dispatch", "push"])
    assert "invalid choice: 'push' (choose from 'pull', 'gather')" in capsys.readouterr().err


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


QUIET_EXITS = (0, 128 + signal.SIGPIPE, -signal.SIGPIPE)


@pytest.mark.parametrize("argv", [
    ["plan", "--shape", "qwen3-30b-a3b", "--ep", "1", "--json"],
    ["plan", "--help"],  # argparse's own exit after the help
])
def test_a_closed_pipe_ends_quietly(argv):
    """stdout is a pipe whose reader closed before the first write (`| head` that went away
    first), so every write fails: deterministic where a real `| head -1` races."""
    read, write = os.pipe()
    os.close(read)
    proc = subprocess.run([sys.executable, "-m", "mokgen", *argv], cwd=ROOT, env=_env(),
                          stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert proc.stderr == "" and proc.returncode in QUIET_EXITS, proc



@pytest.mark.parametrize("ok", [True, False])
def test_compile_run_exits_1_when_the_check_fails(monkeypatch, capsys, ok):
    """compile --run's exit status is the reference check's (a script can rely on it); the
    layer and the GPU call are stand-ins here."""
    from types import SimpleNamespace

    import mokgen.harness.smoke as smoke
    import mokgen.pytorch.api as api

    monkeypatch.setattr(api, "compile_layer", lambda plan, virtual: SimpleNamespace(
        binaries={}, build_seconds=0.0))
    monkeypatch.setattr(smoke, "run_once", lambda layer: ("checked", ok))
    assert cli.main(["compile", "--shape", "tiny", "--ep", "1", "--tokens", "64",
                     "--run"]) == (0 if ok else 1)
    assert "checked" in capsys.readouterr().out


def test_compile_without_nvcc_says_what_is_missing(monkeypatch, capsys):
    """The README's first command on a machine without nvcc: exit 2 and one line naming the
    way out (not a traceback)."""
    import dataclasses

    from mokgen.compiler import build

    monkeypatch.setattr(build, "CONFIG", dataclasses.replace(build.CONFIG,
                                                              nvcc="/nonexistent/nvcc"))
    build.nvcc_version.cache_clear()
    try:
        assert cli.main(["compile", "--shape", "tiny", "--ep", "1", "--tokens", "64"]) == 2
    finally:
        build.nvcc_version.cache_clear()
    err = capsys.readouterr().err
    assert "nvcc not usable (/nonexistent/nvcc)" in err and "MOKGEN_NVCC" in err


def test_run_once_refuses_ranks_that_would_not_fit_the_gpu(monkeypatch):
    """One GPU holds every virtual rank: a check past its free memory is refused with both
    sizes, before any allocation (the stand-in layer has no runtime to call)."""
    from types import SimpleNamespace

    import mokgen
    import mokgen.harness.smoke as smoke

    plan = mokgen.plan(mokgen.shapes.get("kimi-k2.7"), ep=64, tokens_per_rank=2048,
                       gpu="h100-sxm")
    need = smoke.footprint(plan, 256)
    assert need > 80 * 2**30  # all 384 experts' weights and 64 workspaces
    monkeypatch.setattr(smoke.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(smoke.torch.cuda, "mem_get_info", lambda: (78 * 2**30, 80 * 2**30))
    text, ok = smoke.run_once(SimpleNamespace(plan=plan))
    assert not ok and text.startswith("not run: 64 virtual ranks x 256 tokens need about")
    assert f"{need / 2**30:.1f} GiB" in text and "78.0 GiB are free" in text


def test_run_once_without_a_gpu_compiles_only(monkeypatch):
    import mokgen.harness.smoke as smoke

    monkeypatch.setattr(smoke.torch.cuda, "is_available", lambda: False)
    assert smoke.run_once(None) == ("no GPU visible: compiled only", True)
