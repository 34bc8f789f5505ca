"""Kept worlds (course/runtime/workers.py, ``run(..., keep=True, fresh=True)``): one world of workers serves the calls
that follow with its settings, each call in a process forked for it from a worker that never ran code
under test (course/runtime/worker.py), so each call finds what a new world would give it, whatever the
calls before it did or failed to do."""

import os
import sys
import threading
import time

import numpy
import pytest
import torch
import torch.distributed as dist

from course.launch import WorldFailed, run
from course.runtime import workers
from tests.runtime.test_kept_worlds import (
    LASTING_CHANGES,
    ends_the_group,
    leaves_traces,
    mark_of,
    no_kept_world,  # noqa: F401 - its autouse fixture: each test starts with no kept world
    pid,
    raises_after,
    sets_a_timer_and_a_handler,
    signals_and_timers,
)
from tests.runtime.test_launch import alive, builds_ddp, wait_for

# --- worker functions: top level, so every start method can send them ---------------------

PID_CODE = pid.__code__


def forges_the_probe():
    """Issue 47: code under test replaces a check's probe, by name and in place, for the calls after it."""
    module = sys.modules[pid.__module__]
    module.pid = lambda: "forged"
    pid.__code__ = (lambda: "forged").__code__
    return os.getpid()


def what_it_finds():
    """What a call finds of what an earlier call could have changed."""
    return {
        "probe": pid.__code__ is PID_CODE and sys.modules[pid.__module__].pid is pid,
        "all_reduce": dist.all_reduce is dist.distributed_c10d.all_reduce,
        "python threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")),
        "descriptors": len(os.listdir("/proc/self/fd")),
        "signals": [line for line in open("/proc/self/status") if line.startswith(("SigBlk", "SigIgn", "SigCgt"))],
        "timers": open("/proc/self/timers").read() if os.path.exists("/proc/self/timers") else "",
        "variable": os.environ.get("COURSE_LEFT_BEHIND"),
        "cwd": os.getcwd(),
        "torch": torch.rand(3),
        "numpy": float(numpy.random.rand()),
        "dtype": str(torch.get_default_dtype()),
        "grad": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
    }


def waits_for_a_rank_that_raised():
    if dist.get_rank() == 0:
        raise ValueError("on purpose")
    dist.all_reduce(torch.ones(1))


def one_rank_never_ends():
    if dist.get_rank() == 0:
        while True:
            time.sleep(1)


def kept():
    """The workers of the kept worlds: a world kept is one whose workers stay."""
    return set(workers.kept_workers())


def same(found, again):
    for before, after in zip(found, again, strict=True):
        before, after = dict(before), dict(after)
        assert torch.equal(before.pop("torch"), after.pop("torch"))
        assert before == after


# --- tests ----------------------------------------------------------------------------------


def test_a_kept_world_runs_the_next_call_with_its_settings():
    run(pid, 2, keep=True, fresh=True)
    first = kept()
    assert len(first) == 2
    run(pid, 2, keep=True, fresh=True)
    assert kept() == first
    run(pid, 3, keep=True, fresh=True)
    assert len(kept() - first) == 3, "a world of another size is a world of its own"
    before = kept()
    run(pid, 2, keep=True, fresh=True, debug=False)
    assert len(kept() - before) == 2, "so is one with other settings"
    before = kept()
    run(pid, 2, keep=True, fresh=True)
    assert kept() == before


def test_each_call_runs_in_a_process_of_its_own():
    calls = [run(pid, 2, keep=True, fresh=True) for _ in range(3)]
    assert len({p for call in calls for p in call}) == 6
    assert kept().isdisjoint(p for call in calls for p in call), "not in the workers, which never run a call"
    assert not any(alive(p) for call in calls for p in call), "and that process ends with its call"


def test_each_call_reads_the_code_under_test_again(tmp_path):
    (tmp_path / "mlp.py").write_text("MARK = 1\n")
    assert run(mark_of, 2, str(tmp_path), keep=True, fresh=True) == [1, 1]
    (tmp_path / "mlp.py").write_text("MARK = 2\n")
    assert run(mark_of, 2, str(tmp_path), keep=True, fresh=True) == [2, 2]


@pytest.mark.parametrize(
    "changes",
    [
        forges_the_probe,
        leaves_traces,
        *LASTING_CHANGES,
        sets_a_timer_and_a_handler,
        ends_the_group,
    ],
)
def test_no_call_finds_what_an_earlier_call_left(changes):
    """The world is kept, and the next call finds what the first found: the probe that the grader sends by
    name is the checks' own (issue 47), torch is torch's, and nothing of the earlier call's process is left."""
    found = run(what_it_finds, 2, keep=True, fresh=True)
    world = kept()
    pids = run(changes, 2, keep=True, fresh=True)
    again = run(what_it_finds, 2, keep=True, fresh=True)
    assert kept() == world, "the world is kept"
    same(found, again)
    assert found[0]["probe"] and found[0]["all_reduce"]
    assert run(pid, 2, keep=True, fresh=True) != ["forged", "forged"]
    wait_for(lambda: not any(alive(p) for p in pids), 30)


def test_a_calls_timers_signal_handlers_and_mask_are_not_the_next_calls():
    found = run(signals_and_timers, 2, keep=True, fresh=True)
    run(sets_a_timer_and_a_handler, 2, keep=True, fresh=True)
    again = run(signals_and_timers, 2, keep=True, fresh=True)
    assert [f.pop("pid") for f in again] != [f.pop("pid") for f in found]
    assert again == found
    assert again[0]["timer"] == (0.0, 0.0)


def test_a_call_may_leave_a_new_group_of_the_same_shape():
    """tests/helpers.alone runs a function with no process group, then makes one of one rank.
    DDP, which gets a group of its own where collectives are checked, gets one of the new group."""
    run(builds_ddp, 1, keep=True, fresh=True, debug=True)
    world = kept()
    run(ends_the_group, 1, keep=True, fresh=True, debug=True)
    assert run(builds_ddp, 1, keep=True, fresh=True, debug=True) == [None]
    assert kept() == world


@pytest.mark.parametrize(
    "what",
    [
        "nothing",
        "traces",
        "all_reduce",
        "new_group",
        "monitored_barrier",
        "a message from rank 1",
        "SystemExit on rank 1",
        "a thread",
    ],
)
def test_a_call_whose_every_rank_answered_keeps_its_world(what):
    """A stub's NotImplementedError on every rank, or an error after any traffic: every rank's call
    ended, so the next call (the next check) needs no new world, and finds what the first call found."""
    found = run(what_it_finds, 2, keep=True, fresh=True)
    world = kept()
    with pytest.raises(WorldFailed) as caught:
        run(raises_after, 2, what, keep=True, fresh=True)
    assert caught.value.failure.kind in ("error", "no_result")  # a rank's SystemExit: it sent no result
    assert kept() == world
    same(found, run(what_it_finds, 2, keep=True, fresh=True))
    assert kept() == world


def test_a_rank_that_waits_for_one_that_raised_answers_and_the_world_is_kept():
    """The raising rank's process ends with its answer: its peer's collective fails at once."""
    run(pid, 2, keep=True, fresh=True)
    world = kept()
    with pytest.raises(WorldFailed, match="on purpose"):
        run(waits_for_a_rank_that_raised, 2, keep=True, fresh=True)
    assert kept() == world


def test_a_call_that_leaves_a_rank_running_ends_its_world():
    options = dict(keep=True, fresh=True, timeout=3, collective_timeout=60)
    run(pid, 2, **options)
    world = kept()
    with pytest.raises(WorldFailed, match="Timed out"):
        run(one_rank_never_ends, 2, **options)
    assert workers.kept_workers() == []
    wait_for(lambda: not any(alive(p) for p in world), 30)
    run(pid, 2, **options)
    assert kept().isdisjoint(world)
