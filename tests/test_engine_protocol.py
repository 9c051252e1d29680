"""The GEMM engine's channel protocol, as a model run on the CPU (gemm_tile.cuh): a thread
that takes the tasks (the scheduler, schedule_tasks, or the producer itself), a producer
that streams them, the task channel (TASK_SLOTS slots, each freed by 8 warp arrivals), the
ring (STAGES stages; full: the producer's load landing, empty: 8 warp arrivals) and two
consumer warpgroups taking each task together (kBarTile at its end). TMA loads land in any
order, and the mbarrier waits test a parity as the hardware's do, so a waiter two phases
ahead passes. The scheduler pushes task i + 1 once the producer has taken task i (the
`taken` barrier: GemmCfg::SCHEDULER); without one, the producer takes each task itself
after streaming the one before. What it checks: no interleaving deadlocks, the scheduler
never more than one task ahead of the producer, no stage read before its slice landed, and
every ring position read by both warpgroups, in order. The device code is what runs; this
is the protocol it implements, for the orders a GPU test may never hit."""
import random

import pytest

STAGES, SLOTS = 4, 4


def simulate(tasks, rng, scheduler=True):
    """tasks: [k_blocks]. Returns each warpgroup's reads [(position, task index)]."""
    full = [0] * STAGES        # completed phases of each stage's full barrier (data landed)
    flight = []                # stages whose TMA load is issued and not yet landed
    empty_arr = [0] * STAGES   # arrivals in the current phase of each empty barrier
    empty = [0] * STAGES       # completed phases of each empty barrier
    slot_arr = [0] * SLOTS     # arrivals freeing each task slot (8 warps)
    slot_free = [0] * SLOTS    # completed frees of each slot
    channel = []               # pushed tasks: k
    sched = dict(task=0)
    prod = dict(task=0, pos=0, left=None, taken=0)
    wgs = [dict(t=0, pos=0, state="pop", left=0, reads=[]) for _ in range(2)]
    tile_bar = {}              # task index -> warpgroups arrived at kBarTile

    def empty_arrive(s, n):
        empty_arr[s] += n
        if empty_arr[s] == 8:
            empty_arr[s], empty[s] = 0, empty[s] + 1

    def release_slot(i, n=4):
        s = i % SLOTS
        slot_arr[s] += n
        if slot_arr[s] == 8:
            slot_arr[s], slot_free[s] = 0, slot_free[s] + 1

    def step_scheduler():  # push the next task (its slot must be free)
        i = sched["task"]
        if i == len(tasks) or slot_free[i % SLOTS] < i // SLOTS:
            return False
        if scheduler and i > 0 and prod["taken"] < i:  # the producer took task i - 1
            return False
        if not scheduler and (prod["task"] < i or prod["left"] is not None):
            return False  # the producer's own next_task: after streaming task i - 1
        channel.append(tasks[i])
        sched["task"] += 1
        assert len(channel) <= prod["taken"] + 1, "the scheduler ran more than a task ahead"
        return True

    def step_producer():
        if prod["left"] is None:  # take the next task from the channel
            i = prod["task"]
            if i == len(tasks) or i >= len(channel):
                return False
            prod["left"], prod["taken"] = channel[i], prod["taken"] + 1
            return True
        if prod["left"] == 0:
            prod["left"], prod["task"] = None, prod["task"] + 1
            return True
        p = prod["pos"]
        s, r = p % STAGES, p // STAGES
        # mbarrier parity waits: a wait for phase n passes while the barrier's count of
        # completed phases has the other parity, so a waiter two phases ahead passes too
        if empty[s] % 2 != r % 2:  # round r - 1 of the stage not yet freed by its readers
            return False
        assert empty[s] >= r, ("the producer refilled a stage still being read", p)
        flight.append(s)
        prod["pos"], prod["left"] = p + 1, prod["left"] - 1
        return True

    def step_wg(h):
        w = wgs[h]
        i = w["t"]
        if w["state"] == "pop":
            if i == len(tasks) or i >= len(channel):
                return False
            w["state"], w["left"] = "main", channel[i]
            return True
        if w["state"] == "main":
            if w["left"] == 0:  # kBarTile: both warpgroups at this task's end
                tile_bar.setdefault(i, set()).add(h)
                w["state"] = "bar"
                return True
            p = w["pos"]
            s, r = p % STAGES, p // STAGES
            if full[s] % 2 == r % 2:
                return False
            assert full[s] > r, ("a warpgroup read a stage before its slice landed", h, p, i)
            w["reads"].append((p, i))
            empty_arrive(s, 4)  # its 4 warps
            w["pos"], w["left"] = p + 1, w["left"] - 1
            return True
        if w["state"] == "bar":
            if len(tile_bar[i]) < 2:
                return False
            release_slot(i)
            w["t"], w["state"] = i + 1, "pop"
            return True
        raise AssertionError(w["state"])

    def step_tma():  # one issued load lands (a stage is reissued only once freed)
        if not flight:
            return False
        s = flight.pop(rng.randrange(len(flight)))
        full[s] += 1
        return True

    agents = [step_scheduler, step_producer, step_tma, lambda: step_wg(0), lambda: step_wg(1)]
    while True:
        order = rng.sample(agents, len(agents))
        if not any(a() for a in order):
            break
    done = prod["task"] == len(tasks) and all(w["t"] == len(tasks) for w in wgs)
    assert done, ("deadlock", prod, [(w["t"], w["state"]) for w in wgs])
    return [w["reads"] for w in wgs]


def check_reads(tasks, reads):
    """Both warpgroups read every ring position, each task's in order."""
    starts = [0]
    for k in tasks:
        starts.append(starts[-1] + k)
    want = [(p, i) for i, k in enumerate(tasks) for p in range(starts[i], starts[i] + k)]
    for h in (0, 1):
        assert reads[h] == want, h


@pytest.mark.parametrize("scheduler", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_cooperative_tasks_never_deadlock_and_read_their_own_slices(seed, scheduler):
    rng = random.Random(seed)
    tasks = [rng.choice([0, 1, 2, 3, 5, 9, 17]) for _ in range(40)]
    reads = simulate(tasks, rng, scheduler)
    check_reads(tasks, reads)
