"""Kept worlds (course/runtime/workers.py, ``run(..., keep=True)``): one world of workers serves the calls
that follow with its settings, and each call finds what a new world would give it."""

import _thread
import ctypes
import os
import random
import signal
import sys
import threading
import time

import numpy
import pytest
import torch
import torch.distributed as dist

from course import impl
from course.launch import WorldFailed, run
from course.layout import ROOT
from course.runtime import workers
from tests import warm
from tests.runtime.test_launch import alive, builds_ddp, wait_for

# --- worker functions: top level, so every start method can send them ---------------------


def pid():
    return os.getpid()


def what_it_finds():
    return {
        "variable": os.environ.get("COURSE_LEFT_BEHIND"),
        "cwd": os.getcwd(),
        "torch": torch.rand(3),
        "random": random.random(),
        "numpy": float(numpy.random.rand()),
        "dtype": str(torch.get_default_dtype()),
        "grad": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
    }


def leaves_traces():
    os.environ["COURSE_LEFT_BEHIND"] = "1"
    os.chdir(os.path.dirname(os.getcwd()))
    torch.manual_seed(dist.get_rank() + 7)
    random.seed(5)
    numpy.random.seed(5)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(torch.get_num_threads() + 1)
    return os.getpid()


def starts_a_thread():
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    return os.getpid()


def starts_a_thread_threading_does_not_see():
    _thread.start_new_thread(time.sleep, (60,))
    return os.getpid()


def starts_threads_past_its_share():
    """Threads that outlive the call, past the rank's half of the world's share of processes (as the gloo threads of
    the groups that many calls make pile up): OpenMP's, which torch's thread count grows."""
    torch.set_num_threads(300)
    torch.ones(2000, 2000).sum(0)
    return os.getpid()


def keeps_its_callers_output():
    os.dup(1)  # to write into long after its call (a notebook kernel's output)
    return os.getpid()


def ignores_a_signal_from_c():
    ctypes.CDLL(None).signal(signal.SIGUSR2, 1)  # SIG_IGN, behind Python's back
    return os.getpid()


def sets_a_timer_from_c():
    ctypes.CDLL(None).timer_create(0, None, ctypes.byref(ctypes.c_void_p()))  # CLOCK_REALTIME, SIGALRM when armed
    return os.getpid()


def sets_a_timer_and_a_handler():
    signal.signal(signal.SIGALRM, lambda *args: print("a timer of an earlier call", flush=True))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.setitimer(signal.ITIMER_REAL, 30)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    return os.getpid()


def signals_and_timers():
    return {
        "timer": signal.getitimer(signal.ITIMER_REAL),
        "SIGALRM": str(signal.getsignal(signal.SIGALRM)),
        "SIGTERM": str(signal.getsignal(signal.SIGTERM)),
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "pid": os.getpid(),
    }


def replaces_all_reduce():
    dist.all_reduce = lambda *args, **kwargs: None
    return os.getpid()


def all_reduce_is_torchs():
    return dist.all_reduce is dist.distributed_c10d.all_reduce


def ends_the_group():
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return os.getpid()


def raises():
    raise ValueError("on purpose")


def raises_after(what):
    """Raise on every rank after what: each a trace that a peer may wait for, or that the next call would meet."""
    rank = dist.get_rank()
    if what == "all_reduce":
        dist.all_reduce(torch.ones(1))
    elif what == "new_group":
        dist.new_group([0, 1])
    elif what == "monitored_barrier":
        dist.monitored_barrier()
    elif what == "a message from rank 1" and rank == 1:
        dist.isend(torch.ones(1), 0)
    elif what == "SystemExit on rank 1" and rank == 1:
        raise SystemExit(3)
    elif what == "a thread":
        starts_a_thread()
    elif what == "traces":
        leaves_traces()
    raise NotImplementedError(f"after {what}")


def prints(text):
    print(f"rank {dist.get_rank()}: {text}", flush=True)
    print(f"rank {dist.get_rank()} on stderr: {text}", file=sys.stderr, flush=True)


def mark_of(folder):
    return impl.load(folder).mlp.MARK


def mark_through_mydp(folder):
    return impl.load(folder).mydp.MARK


def imports_mlp():
    import mlp  # noqa: F401 - what a reference world refuses, wherever mlp.py is

    return "imported"


def exited(pid):
    """Every thread of the process has ended: its leader shows as a zombie while gloo's threads still run."""
    try:
        return not alive(pid) and os.listdir(f"/proc/{pid}/task") in ([], [str(pid)])
    except OSError:
        return True


# --- tests ----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_kept_world():
    workers.stop_kept()
    yield
    workers.stop_kept()


def test_a_kept_world_runs_the_next_call_with_its_settings():
    first = run(pid, 2, keep=True)
    assert run(pid, 2, keep=True) == first
    assert sorted(workers.kept_workers()) == sorted(first)
    assert set(run(pid, 3, keep=True)).isdisjoint(first), "a world of another size is a world of its own"
    assert set(run(pid, 2, keep=True, debug=False)).isdisjoint(first), "so is one with other settings"
    assert run(pid, 2, keep=True) == first


def test_a_reference_world_loads_no_code_under_test_and_shares_no_world(tmp_path):
    """Issue 36: what a judge compares with (torch's own DDP, ...) is computed in a world of its own, which never
    loaded a submission: one that patched torch or the checks in its kept world cannot forge it."""
    (tmp_path / "mlp.py").write_text("MARK = 1\n")
    loaded = run(mark_of, 2, str(tmp_path), keep=True, sandbox=True)
    assert loaded == [1, 1]
    reference = run(pid, 2, keep=True, sandbox=True, reference=True)
    assert set(reference).isdisjoint(run(pid, 2, keep=True, sandbox=True)), "a world of its own"
    assert run(pid, 2, keep=True, sandbox=True, reference=True) == reference, "kept for the next reference"
    for probe, args in ((mark_of, (str(tmp_path),)), (imports_mlp, ())):
        with pytest.raises(WorldFailed, match="a reference world runs no code under test"):
            run(probe, 2, *args, keep=True, reference=True)


def test_a_reference_world_loads_the_judges_reference_solutions_and_nothing_else(tmp_path, monkeypatch):
    """Issue 47: where the grade counts, the reference solutions answer the cases a check draws (checks/helpers.py's
    judge_world()), in a reference world: it loads the judge's folder (course/impl.py's judge()), its files
    importing one another, and no other folder."""
    judge, other = tmp_path / "judge", tmp_path / "other"
    for folder, mark in ((judge, 2), (other, 1)):
        folder.mkdir()
        (folder / "mlp.py").write_text(f"MARK = {mark}\n")
        (folder / "mydp.py").write_text("from mlp import MARK\n")
    monkeypatch.setenv("COURSE_JUDGE", str(judge))
    assert run(mark_through_mydp, 2, str(judge), keep=True, reference=True) == [2, 2]
    for probe, args in ((mark_of, (str(other),)), (imports_mlp, ())):
        with pytest.raises(WorldFailed, match="a reference world runs no code under test"):
            run(probe, 2, *args, keep=True, reference=True)


def test_a_world_not_kept_ends_with_its_call():
    first = run(pid, 2)
    assert workers.kept_workers() == []
    assert set(run(pid, 2)).isdisjoint(first)
    assert not any(alive(p) for p in first)


def test_each_call_finds_what_the_first_found():
    found = run(what_it_finds, 2, keep=True)
    pids = run(leaves_traces, 2, keep=True)
    again = run(what_it_finds, 2, keep=True)
    assert run(pid, 2, keep=True) == pids, "restored, not ended"
    for before, after in zip(found, again):
        assert torch.equal(before.pop("torch"), after.pop("torch"))
        assert before == after


def test_each_call_reads_the_code_under_test_again(tmp_path):
    (tmp_path / "mlp.py").write_text("MARK = 1\n")
    assert run(mark_of, 2, str(tmp_path), keep=True) == [1, 1]
    (tmp_path / "mlp.py").write_text("MARK = 2\n")
    assert run(mark_of, 2, str(tmp_path), keep=True) == [2, 2]


# What a call may leave that its worker cannot undo (a shared call's world is stopped for it).
LASTING_CHANGES = [
    starts_a_thread,
    replaces_all_reduce,
    starts_a_thread_threading_does_not_see,
    starts_threads_past_its_share,
    keeps_its_callers_output,
    ignores_a_signal_from_c,
    sets_a_timer_from_c,
]


@pytest.mark.parametrize("changes", LASTING_CHANGES)
def test_a_call_that_leaves_what_cannot_be_undone_ends_its_world(changes):
    pids = run(changes, 2, keep=True)
    assert workers.kept_workers() == []
    assert set(run(pid, 2, keep=True)).isdisjoint(pids)
    assert run(all_reduce_is_torchs, 2, keep=True) == [True, True]
    wait_for(lambda: not any(alive(p) for p in pids), 30)


def test_a_calls_timers_signal_handlers_and_mask_are_undone():
    found = run(signals_and_timers, 2, keep=True)
    pids = run(sets_a_timer_and_a_handler, 2, keep=True)
    again = run(signals_and_timers, 2, keep=True)
    assert [f.pop("pid") for f in again] == pids, "restored, not ended"
    assert again == [{k: v for k, v in f.items() if k != "pid"} for f in found]
    assert again[0]["timer"] == (0.0, 0.0)


def test_a_call_may_leave_a_new_group_of_the_same_shape():
    """tests/helpers.alone runs a function with no process group, then makes one of one rank.
    DDP, which gets a group of its own where collectives are checked, gets one of the new group."""
    run(builds_ddp, 1, keep=True, debug=True)
    pids = run(ends_the_group, 1, keep=True, debug=True)
    assert run(builds_ddp, 1, keep=True, debug=True) == [None]
    assert run(pid, 1, keep=True, debug=True) == pids


@pytest.mark.parametrize(
    "what",
    ["all_reduce", "new_group", "monitored_barrier", "a message from rank 1", "SystemExit on rank 1", "a thread"],
)
def test_a_failed_call_ends_its_world(what):
    pids = run(pid, 2, keep=True)
    with pytest.raises(WorldFailed) as caught:
        run(raises_after, 2, what, keep=True)
    assert caught.value.failure.kind in ("error", "no_result")  # a rank's SystemExit: it sent no result
    assert workers.kept_workers() == []
    assert not any(alive(p) for p in pids)
    assert set(run(pid, 2, keep=True)).isdisjoint(pids)


def test_a_call_whose_every_rank_raised_before_sending_anything_keeps_its_world():
    """A stub's NotImplementedError on every rank: no rank waits for another, so the next call (the
    next check of unwritten code) needs no new world; it finds what the first call found."""
    found = run(what_it_finds, 2, keep=True)
    pids = run(pid, 2, keep=True)
    for what in ("nothing", "traces"):
        with pytest.raises(WorldFailed) as caught:
            run(raises_after, 2, what, keep=True)
        assert caught.value.failure.kind == "error" and f"after {what}" in str(caught.value)
        assert sorted(workers.kept_workers()) == sorted(pids)
    again = run(what_it_finds, 2, keep=True)
    assert run(pid, 2, keep=True) == pids
    for before, after in zip(found, again):
        assert torch.equal(before.pop("torch"), after.pop("torch"))
        assert before == after
    assert run(all_reduce_is_torchs, 2, keep=True) == [True, True]


MODES = pytest.mark.parametrize("fresh", [False, True], ids=["shared", "fresh"])


@MODES
def test_a_kept_worker_killed_while_it_waits_is_replaced(fresh):
    run(pid, 2, keep=True, fresh=fresh)
    world = sorted(workers.kept_workers())
    os.kill(world[1], signal.SIGKILL)
    wait_for(lambda: exited(world[1]), 30)
    run(pid, 2, keep=True, fresh=fresh)
    assert set(workers.kept_workers()).isdisjoint(world)
    assert not any(alive(p) for p in world)


@MODES
def test_a_kept_worker_writes_where_its_caller_writes_now(capfd, fresh):
    """As a notebook cell's output or a test's captured output: where it goes changes between calls."""
    with capfd.disabled():
        run(pid, 2, keep=True, fresh=fresh)
    run(prints, 2, "first", keep=True, fresh=fresh)
    first = capfd.readouterr()
    run(prints, 2, "second", keep=True, fresh=fresh)
    second = capfd.readouterr()
    assert sorted(first.out.splitlines()) == ["rank 0: first", "rank 1: first"]
    assert sorted(second.out.splitlines()) == ["rank 0: second", "rank 1: second"]
    assert sorted(second.err.splitlines()) == ["rank 0 on stderr: second", "rank 1 on stderr: second"]


@MODES
def test_stop_kept_ends_the_workers(fresh):
    run(pid, 2, keep=True, fresh=fresh)
    world = workers.kept_workers()
    workers.stop_kept()
    assert workers.kept_workers() == []
    assert not any(alive(p) for p in world)


@MODES
def test_kept_workers_end_with_the_process_that_kept_them(tmp_path, fresh):
    script = tmp_path / "keeps.py"
    script.write_text(
        "from course.launch import run\nfrom course.runtime import workers\n"
        f"from tests.runtime.test_kept_worlds import pid\nrun(pid, 2, keep=True, fresh={fresh})\n"
        "print(*workers.kept_workers())\n"
    )
    done = warm.run([str(script)], cwd=ROOT, env=os.environ | {"PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2
    wait_for(lambda: not any(alive(p) for p in pids), 30)
