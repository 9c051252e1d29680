"""A rank killed mid-training at R = 2 (marked multigpu; needs 2 GPUs):

    python -m pytest -q -m multigpu tests/test_multigpu_faults.py

Plain pytest, not torchrun: torchrun tears every rank down once one dies, so the test starts
both ranks itself (this file run as a script, one process per GPU, NCCL rendezvous over a
TCPStore on localhost that rank 0 hosts) and watches them from outside under an overall
timeout, so a hang fails the test instead of blocking the run.

After a few training steps rank 1 SIGKILLs itself, either while rank 0 is already inside its
next call waiting on it ("waiting"), or right after launching its own forward, whose kernels
are then in flight ("in-flight"; rank 0 then waits in its backward). Rank 0 must raise the
watchdog's RuntimeError naming peer rank 1 within watchdog_s + 1 s of entering the call, and
again on the next call (the watchdog re-arms; a dead peer never makes a call hang), and its
device must still work. It then aborts its NCCL communicator in a thread given 10 s (with a
dead peer NCCL's teardown may wait forever) and leaves with os._exit."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.multigpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WATCHDOG_S = 2.0
TIMEOUT_S = 240  # both ranks: start, compile (cached: seconds), steps, two watchdogs, abort
REPORT = "FAULT-REPORT "


def _skip_reason():
    if "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ:
        return ("run with plain pytest, not torchrun: the test starts its own two ranks "
                "(python -m pytest -m multigpu tests/test_multigpu_faults.py)")
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        return f"needs 2 GPUs, {torch.cuda.device_count()} visible"
    return None  # no GPU at all: conftest skips every multigpu test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(rank: int, port: int, mode: str, logs) -> subprocess.Popen:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
               LOCAL_RANK=str(rank), WORLD_SIZE="2", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    with open(logs / f"rank{rank}.out", "w") as out, open(logs / f"rank{rank}.err", "w") as err:
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), mode], env=env,
                                stdout=out, stderr=err, cwd=ROOT)


def _tail(logs, rank: int, lines: int = 25) -> str:
    text = "".join((logs / f"rank{rank}.{k}").read_text() for k in ("out", "err"))
    return f"\n--- rank {rank} ---\n" + "\n".join(text.splitlines()[-lines:])


@pytest.mark.parametrize("mode", ["waiting", "in-flight"])
def test_a_killed_rank_makes_the_survivor_raise_not_hang(mode, tmp_path):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    port = _free_port()
    procs = [_launch(r, port, mode, tmp_path) for r in (0, 1)]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        alive = [r for r, p in enumerate(procs) if p.poll() is None]
        pytest.fail(f"{mode}: rank(s) {alive} still running after {TIMEOUT_S} s: a hang"
                    + _tail(tmp_path, 0) + _tail(tmp_path, 1))
    finally:
        for p in procs:  # only ours, by handle
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = _tail(tmp_path, 0) + _tail(tmp_path, 1)
    assert procs[1].returncode == -signal.SIGKILL, \
        f"rank 1 did not die by its own SIGKILL (exit {procs[1].returncode})" + logs
    lines = [s for s in (tmp_path / "rank0.out").read_text().splitlines() if s.startswith(REPORT)]
    assert lines, f"rank 0 reported nothing (exit {procs[0].returncode})" + logs
    report = json.loads(lines[0][len(REPORT):])
    print(json.dumps(report))
    for i, call in enumerate(report["calls"]):
        assert call["error"] is not None, f"call {i} after the kill returned normally" + logs
        assert "watchdog" in call["error"] and "peer rank 1" in call["error"], call["error"]
        assert call["seconds"] <= WATCHDOG_S + 1.0, \
            f"call {i} raised after {call['seconds']:.2f} s (watchdog {WATCHDOG_S} s)"
    assert report["device_ok"], "rank 0's device failed after the watchdog" + logs
    assert procs[0].returncode == 0, f"rank 0 exited with {procs[0].returncode}" + logs


# ------------------------------------------------------------------ one rank (the script)
def _rank_main(mode: str) -> None:
    import threading

    import torch.distributed as dist

    import mokgen
    from mokgen.harness.workloads import make_inputs

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    shape, n = mokgen.shapes.get("gpu-small"), 256
    layer = mokgen.compile(shape, ep=2, tokens_per_rank=n, group=dist.group.WORLD,
                           watchdog_s=WATCHDOG_S)
    inputs = make_inputs(shape, 2, n, seed=1234)
    leaves = {k: (v[rank] if isinstance(v, list) else v).detach().clone().requires_grad_()
              for k, v in inputs.items() if v is not None}
    dy = torch.randn(leaves["x"].shape, device="cuda", dtype=torch.bfloat16,
                     generator=torch.Generator(device="cuda").manual_seed(rank))

    def step(backward: bool = True):
        for t in leaves.values():
            t.grad = None
        y = layer(**leaves)
        if backward:
            y.backward(dy)

    for _ in range(5):
        step()
    layer.synchronize()
    dist.barrier()  # the last collective: no NCCL work is pending on either rank after it
    torch.cuda.synchronize()
    if rank == 1:
        if mode == "in-flight":
            step(backward=False)  # its forward's kernels are queued or running
        else:
            time.sleep(0.5)  # rank 0 has entered its next call by now, waiting on us
        os.kill(os.getpid(), signal.SIGKILL)
    report = {"mode": mode, "watchdog_s": WATCHDOG_S, "calls": []}
    for _ in range(2):  # the peer stays dead: each call raises, none hangs
        t0 = time.monotonic()
        error = None
        try:
            step()
            layer.synchronize()
        except RuntimeError as e:
            error = str(e)
        report["calls"].append({"seconds": round(time.monotonic() - t0, 3), "error": error})
    report["device_ok"] = bool(torch.ones(1 << 20, device="cuda").sum().item() == 1 << 20)
    print(REPORT + json.dumps(report), flush=True)
    t0 = time.monotonic()
    abort = threading.Thread(target=getattr(dist.distributed_c10d, "_abort_process_group",
                                            dist.destroy_process_group), daemon=True)
    abort.start()
    abort.join(10.0)
    print(f"NCCL abort {'returned' if not abort.is_alive() else 'still waiting'} after "
          f"{time.monotonic() - t0:.1f} s", flush=True)
    os._exit(0)


if __name__ == "__main__":
    _rank_main(sys.argv[1])
