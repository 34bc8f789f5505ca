"""Start a world of worker processes, run one function on every rank, and always come back.

``run(fn, world_size, *args)`` starts ``world_size`` processes, joins them into a
torch.distributed process group (gloo on CPU), calls ``fn(*args)`` on every rank and returns the
list of their return values, indexed by rank. It never hangs and never leaves a process behind:

- Rendezvous goes through a FileStore in a fresh temporary folder, so no port is chosen and two
  worlds started at the same moment cannot collide.
- Collectives time out after ``collective_timeout`` seconds; the whole world after ``timeout``.
- A rank's result and its failure travel as data (torch.save, read back with weights_only), so
  nothing a worker sends can run code here. A rank that ends without sending one has failed.
- A worker sees only its own pipe and stack file (other descriptors are closed after fork); what
  it starts dies with the world (workers and this process are child subreapers on Linux).
- With ``debug=True`` the ranks compare every collective before it starts, on every group: the
  same one, with the same root, reduce op, shape and dtype (course/runtime/instrument.py's Agreement).
- Workers ignore Ctrl-C (the parent stops them and says where they were) and die with their
  parent (Linux; elsewhere they end when its pipe closes). Their output is line-buffered, so two
  ranks never share a line, and goes where the parent's goes at each call.
- ``keep=True`` (the checks): a world whose call succeeded and left its workers as it found them
  serves the next call with the same settings, instead of new processes (a world costs about
  0.1 s of start-up and warm-up, a call on a kept one a few ms). Each call still gets the code
  under test read afresh, and the random state, environment, working folder, threads, defaults,
  signal handlers and mask the world's first call found, with no timer set. A call that fails
  stops its world, unless every rank raised before it made a group or sent or started anything (a
  stub's NotImplementedError: no rank waits for another); so does a call that times out, starts a
  thread, replaces a function of torch, ends the process group, sets a signal handler from C or
  keeps a descriptor that is not the world's own (its caller's output, a file). Kept workers end
  with this process (``stop_kept`` ends them sooner).
- ``fresh=True`` with ``keep`` (where a grade counts, for_credit()): the workers never run a call.
  Each call runs in a process forked for it from its rank's worker, which imported torch, the
  course and the checks and never code under test; it joins a process group of its own (forked and
  joined before the call comes), and is killed with all it started once every rank has answered.
  No call finds anything an earlier one left, whatever it did (a check's probe replaced, a patched
  torch, a thread, a timer); a world is stopped only where a rank did not answer.

What went wrong is diagnosed in course/runtime/failure.py; ``WorldFailed.failure`` carries it.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import importlib
import io
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch

from course import impl
from course.layout import ROOT
from course.runtime import env, failure, sandbox, uprobes
from course.runtime.instrument import (
    read_board,
)
from course.runtime.processes import (
    PASS_STREAMS,
    OwnTime,
    ctrl_c_held,
    descendants,
    kill,
    processes,
    reap,
    send_streams,
)
from course.runtime.worker import ANSWERED, ENDED, GONE, WorkerSettings, board_path, worker


@dataclasses.dataclass(frozen=True)
class Observed:
    """A call's results, and what the kernel counted of it, read by the process that started the world,
    not by a worker: a fact no code under test can write (run's ``observe``)."""

    results: list
    # The bytes its ranks sent one another during the call over the world's own network (a sandbox's,
    # course/runtime/sandbox.py), headers included: at least what they sent. None without a sandbox,
    # whose ranks share the machine's loopback with every other process.
    loopback_bytes: int | None
    # (rank, name) -> how many times that rank's processes entered that function of torch's during the call
    # (course/runtime/uprobes.py's ENTRIES), as the kernel counted them. None where the kernel counts none, or
    # the call was not counted (run's count_calls).
    calls: dict | None = None


class WorldFailed(RuntimeError):
    """A world that did not finish; ``failure`` says how (course.runtime.failure.Failure)."""

    def __init__(self, failure: failure.Failure):
        super().__init__(failure.report())
        self.failure = failure

    @property
    def summary(self) -> str:
        return self.failure.report()

    def __str__(self) -> str:
        return self.summary


_live_lock = threading.Lock()
_live: set = set()  # pids of the workers of every world now running in this process


def _own_helpers() -> set:
    """This process's long-lived children that are not a world's: the forkserver, mp's tracker."""
    from multiprocessing import forkserver, resource_tracker

    helpers = {forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid}
    return {p for p in helpers if p} | {c.pid for c in mp.active_children()}


# --- in the parent --------------------------------------------------------------------------

_needed: set = set()  # of env.ON_DEMAND_MODULES: what this process's workers have needed


def expect_many_worlds() -> None:
    """Say that this process will start many worlds (the checks do): the first fork imports what
    workers import on demand, once here, instead of once per rank of the first world that steps and
    again here after it. A process whose worlds build no optimizer would pay about 1 s for nothing."""
    _needed.update(env.ON_DEMAND_MODULES)


def _context(method: str):
    ctx = mp.get_context(method)
    if method == "fork":
        _import_for_workers()
    elif method == "forkserver":
        ctx.set_forkserver_preload(env.FORKSERVER_PRELOAD)
    return ctx


def _import_for_workers() -> None:
    for name in [*env.WORKER_MODULES, *sorted(_needed)]:
        importlib.import_module(name)


def _import_for_this_process() -> None:
    for name in env.PARENT_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # a module another torch does not have: nothing imports it then
            pass


def ready_to_fork() -> None:
    """Before this process forks a copy of itself that starts worlds too (course/grading/plugin.py's second
    grading process): import what workers need and freeze, once here rather than once in each.
    The copy's workers, orphaned if it is stopped, come to this process to be reaped (stop_tree)."""
    _import_for_workers()
    _freeze_once()
    sandbox.adopt_orphans()


_frozen = False


def _freeze_once() -> None:
    """Before this process's first world: what it has imported (torch, the checks) leaves the cyclic
    garbage collector's care for good. Its collections, and those of every worker forked from it,
    then skip those objects, instead of walking them all and so copying, in each worker, the pages
    they are on (grading an exercise: about a quarter less time). Garbage made later is collected."""
    global _frozen
    if not _frozen:
        gc.freeze()
        _frozen = True
    gc.enable()  # off while the grader imported (course/__main__.py), whatever the start method


def _seconds_from_env(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def run(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float | None = None,
    collective_timeout: float | None = None,
    backend: str = "gloo",
    device: str = "cpu",
    start_method: str | None = None,
    debug: bool | None = None,
    port: int | None = None,
    keep: bool = False,
    sandbox: bool = False,
    reference: bool = False,
    fresh: bool | None = None,
    observe: bool = False,
    count_calls: bool | tuple = False,
    per_rank: list | Callable | None = None,
    deaths: tuple = (),
) -> list | Observed:
    """Run ``fn(*args)`` on every rank of a new world; return the results by rank.

    Raises WorldFailed when any rank fails, when the world runs past ``timeout`` seconds, or when
    ranks call mismatched collectives (with ``debug``). Defaults come from COURSE_TIMEOUT (600 s),
    COURSE_COLLECTIVE_TIMEOUT (60 s, at most half the world's limit, so a rank stuck in a message
    is named before the world is stopped) and COURSE_DEBUG (set: check collectives). ``device``
    is "cpu" or "cuda" (rank r on cuda:r); course.device.current_device() tells each rank its own.
    Results must be data: tensors, numbers, strings, None, and lists, tuples and dicts of those.
    With ``keep``, a world kept by an earlier call with the same settings runs it (module docstring);
    with ``fresh`` too (default: for_credit()), in a process of the call's own.
    With ``observe``, an Observed: the results and what the kernel counted of the call; with ``count_calls`` too,
    its calls (course/runtime/uprobes.py): what each rank used of the parts of torch that an exercise forbids,
    those ``count_calls`` names (True: every one).
    ``per_rank``: arguments for each rank alone, after ``args`` (rank r calls ``fn(*args,
    *per_rank[r])``): what one rank is given, no other rank's process ever holds. Where it is a
    callable, it is called for that list once the world's processes run (a world forked while this
    process held every rank's arguments would hold them all, in memory a submission can search).
    ``deaths``: the ranks whose death by SIGKILL is planned (exercise 17 kills a rank to see training survive
    it): such a death is no failure, and that rank's result is None; no closing barrier waits for it. Whatever
    else fails, a survivor's exception among it, fails the world as any failure does. A rank can kill itself only
    where it is not the first process of a pid namespace (the kernel ignores its own signals): in a sandboxed
    world, with ``fresh``.
    With ``sandbox`` (the checks), the workers are confined before they run anything (course/runtime/sandbox.py);
    after sandbox_every_world() (the grader, the notebooks' checks process) every world is.
    With ``reference`` (what a judge compares with: torch's own DDP, ZeroRedundancyOptimizer, ...), the
    workers may not load the code under test (course/impl.py's refuse()) and are not sandboxed: their
    worlds are kept apart from every other, so no submission's import ever ran in the process that
    computes what it is compared with.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    env.choose_backend(backend, device)  # refuses nccl for CPU tensors before any worker starts
    timeout = timeout if timeout is not None else _seconds_from_env("COURSE_TIMEOUT", 600)
    if collective_timeout is None:
        collective_timeout = min(_seconds_from_env("COURSE_COLLECTIVE_TIMEOUT", 60), max(1.0, timeout / 2))
    debug = debug if debug is not None else bool(os.environ.get("COURSE_DEBUG"))
    threads = env.threads_per_worker(world_size, env.usable_cores())
    method = start_method or env.default_start_method(sys.platform, threads, torch.cuda.is_initialized(), device)
    # Pickled here, whatever the start method: every method then accepts the same functions, ones
    # defined at the top level of an importable module (not in a notebook cell).
    try:
        call = pickle.dumps((fn, args, not deaths))  # no closing barrier where a rank may die: it would wait for it
    except Exception as exc:
        raise TypeError(
            f"{fn!r} and its arguments must be picklable by reference: define it at the top level of a .py file ({exc})"
        ) from exc

    def calls() -> list:
        """Each rank's pickled call. A callable per_rank is called here, once the world's processes run: no
        process of the world was forked while this one held what it gives them."""
        own = per_rank() if callable(per_rank) else per_rank
        if own is None:
            return [call] * world_size
        if len(own) != world_size:
            raise ValueError(f"per_rank holds {len(own)} ranks' arguments for a world of {world_size}")
        return [pickle.dumps((fn, (*args, *mine), not deaths)) for mine in own]

    child_env = env.loopback_settings(sys.platform)
    level = sandbox_level() if (sandbox or _every_world_sandboxed) and not reference else None
    confinement = level.name if level else "none"
    # Where grades are made, the workers see the course's public files and the code graded, no more.
    viewed = _every_world_sandboxed and confinement != "none" and not level.unseen
    view = submission_view() if viewed else None
    keep = keep and port is None and PASS_STREAMS
    fresh = keep and hasattr(os, "fork") and (fresh if fresh is not None else for_credit())
    key = (world_size, threads, backend, device, collective_timeout, method, tuple(sorted(child_env.items())))
    key += (confinement, view, reference, debug, fresh)
    world = _kept.take(key) if keep else None
    ended = False
    try:
        if world is not None:
            try:
                world.call(calls(), observe, _names(count_calls) if observe else ())
            except OSError:  # a kept worker ended while it waited (killed from outside)
                world.stop()
                world = None
        if world is None:
            settings = WorkerSettings(
                world_size, threads, backend, device, "", port, "", collective_timeout, child_env, keep, confinement
            )
            # The comparison's exchanges are CPU tensors: gloo only (NCCL compares nothing, docs/design.md).
            compare = debug and backend == "gloo"
            settings = dataclasses.replace(settings, view=view, reference=reference, compare=compare, fresh=fresh)
            world = _World.start(method, settings)
            world.call(calls(), observe, _names(count_calls) if observe else ())
        world.timeout, world.deaths = timeout, frozenset(deaths)
        try:
            results = world.collect()
            if observe and fresh and world.reusable:
                # The call's processes end first: the kernel adds what an ended process counted to its parent's.
                world.reusable = ended = world.ended_call()
            return Observed(results, world.loopback_sent(), world.calls_made()) if observe else results
        finally:
            if keep and world.reusable and (not fresh or ended or world.ended_call()):
                _kept.put(key, world)
                world = None
    except KeyboardInterrupt:
        if world is None:  # while it started: start stopped what it had started
            raise
        world.interrupted()
    finally:
        if world is not None:
            world.stop()


def _names(count_calls: bool | tuple) -> tuple:
    """The entries of uprobes.ENTRIES that run's count_calls names."""
    return tuple(uprobes.ENTRIES) if count_calls is True else tuple(count_calls or ())


def for_credit() -> bool:
    """Whether this grade counts (COURSE_FOR_CREDIT set: Gradescope's autograder, make autograde): then
    every call of a kept world runs in a process of its own, forked from a worker that never ran code
    under test (course/runtime/worker.py), so that no call can reach the next. It costs about 50 ms a
    call on 2 cores (docs/design.md); a student's own grade, feedback they control anyway, shares its
    worker's process between calls."""
    return bool(os.environ.get("COURSE_FOR_CREDIT"))


_every_world_sandboxed = False


def sandbox_every_world() -> None:
    """From now on, in this process and those it forks, every world is sandboxed, whatever its
    caller asked: where grades are made, a check that starts a world its own way runs submission
    code confined all the same. Reference worlds (run's ``reference``) load no submission code."""
    global _every_world_sandboxed
    _every_world_sandboxed = True


def sandbox_level() -> sandbox.Level:
    """The sandbox of this machine, for workers that must read the course, the code under test and torch."""
    # Only where grades are made are the workers given a view, and only a view lets a sandbox user read
    # what the grader's user keeps to itself (a Python under /root): elsewhere (the tests' worlds, whose
    # code under test is a folder of their own) the level is the one that works without.
    viewed = impl.selected() if _every_world_sandboxed else None
    return sandbox.level((ROOT, impl.selected(), os.path.dirname(torch.__file__)), viewed)


def submission_view() -> tuple:
    """What the workers of a world where grades are made see (course/runtime/sandbox.py's view): the course
    and the code under test."""
    return sandbox.view(impl.selected())


_POLL = 0.25  # seconds between looks at whether a worker's process has ended
_GRACE = 1.0  # own time, so that a loaded machine does not cost a world whose every rank answers
# At most this long for the workers to end a call's processes: a worker that a call stopped (SIGSTOP,
# under "uid" its user's to send) must not hold the grader; its world is stopped instead.
_ENDING = 30.0
# How long every rank's waits board must stay as it was before a deadlock is reported: a rank that has
# just been answered may not have run since to say so (a loaded machine), a message may be on its way.
_STILL = 1.0
# Between the two asks for the stack of a rank that runs: a loop that does not end goes round in it
# (and what it calls returns) many times over.
_LOOP_INTERVAL = 0.1


class _World:
    """The parent's view of one world: its processes, their pipes, and what they sent."""

    def __init__(self, world_size: int, workdir: str, children_before: set, guard: sandbox.Guard | None):
        self.world_size, self.stack_dir, self.children_before = world_size, workdir, children_before
        self.guard = guard  # what confines its workers (course/runtime/sandbox.py), stopped after them
        self.timeout, self.deaths = 0.0, frozenset()
        self.procs: list = []
        self.conns: list = []
        self.results: dict = {}
        self.reports: list = []
        self.ended: list = []
        self.pending: set = set()
        self.reusable = False
        self.needed: set = set()  # of env.CALL_MODULES: what its calls have imported
        self.stacks_before: dict = {}  # the size of each rank's stack file when the call began
        self.clock: OwnTime | None = None  # the call's own time, from collect() on
        self.loopback: int | None = None  # the world's loopback bytes (sandbox.Guard's) as an observed call began
        self.counter: uprobes.Counter | None = None  # the kernel counts torch's entries from the first call counted
        self.counted: dict | None = None  # its counts as a counted call began
        self.reference = False
        self.asked_kernel = False  # whether the counter was asked for: once, the kernel gives it or not

    @classmethod
    def start(cls, method: str, settings: WorkerSettings) -> _World:
        """Start the ranks of settings in a private folder (its store and stack files)."""
        ctx = _context(method)
        _import_for_this_process()
        sandbox.adopt_orphans()  # a worker's orphans come here, to be stopped with the world
        workdir = tempfile.mkdtemp(prefix="course-world-")
        children = {p for p, parent in processes().items() if parent == os.getpid()}
        world = cls(settings.world_size, workdir, children, None)
        world.reference = settings.reference
        own = sandbox.own_folder(workdir)  # the one folder made for the workers to write
        try:
            settings = dataclasses.replace(settings, store_path=os.path.join(own, "store"), stack_dir=workdir)
            if settings.sandbox == "none":
                os.mkdir(own)
            else:
                world.guard = sandbox.Guard.start(settings.sandbox, workdir)
                if settings.view is not None:
                    sandbox.publish(workdir, settings.view)
                extra = {"HOME": own, "TMPDIR": own}
                settings = dataclasses.replace(settings, env=settings.env | extra, guard=world.guard.handle)
        except BaseException:
            world.stop()
            raise
        world_size = settings.world_size
        _freeze_once()
        try:
            for rank in range(world_size):
                here, there = ctx.Pipe(duplex=True)  # a socket: descriptors travel on it (send_streams)
                proc = ctx.Process(target=worker, args=(rank, settings, there), name=f"rank{rank}", daemon=True)
                with _live_lock, ctrl_c_held():  # a worker forked is one that stop() finds
                    proc.start()
                    _live.add(proc.pid)
                    world.procs.append(proc)
                    world.conns.append(here)
                there.close()  # the child holds the only other end: its exit reads as EOF here
        except BaseException:
            world.stop()
            raise
        return world

    def call(self, calls: list, observe: bool = False, count_calls: tuple = ()) -> None:
        """Hand each rank its pickled (fn, args), and this process's stdout and stderr as they are now; with
        observe, read first what the world's loopback has carried (loopback_sent()); with count_calls, the kernel's
        counts of those of uprobes.ENTRIES (calls_made())."""
        self.results, self.reports, self.ended, self.reusable = {}, [], [], False
        self.loopback = self.guard.loopback_bytes() if observe and self.guard is not None else None
        if count_calls and not self.asked_kernel and not self.reference:
            self.asked_kernel = True
            # From the first call counted, before it runs: a call forked afresh for credit, or this one, is counted
            # whole (an earlier call's processes are gone; a kept world's threads left by one are stopped with it).
            self.counter = uprobes.Counter.attach([proc.pid for proc in self.procs], count_calls)
        elif count_calls and self.counter is not None and not self.counter.count(count_calls):
            self.counter.close()
            self.counter = None
        self.counted = self.counter.counts() if count_calls and self.counter is not None else None
        self.stacks_before = {r: self._stack_size(r) for r in range(self.world_size)}
        for proc, conn, call in zip(self.procs, self.conns, calls):
            conn.send_bytes(call)
            conn.send_bytes(" ".join(sorted(self.needed)).encode())
            send_streams(conn, proc.pid)

    def collect(self) -> list:
        rank_of = {id(c): r for r, c in enumerate(self.conns)}
        self.pending = set(range(self.world_size))
        self.clock = OwnTime([proc.pid for proc in self.procs])  # the limits are of the world's own time
        grace_end = None  # after a first failure, peers get _GRACE of the world's own time to report theirs
        kept = []
        self.still = (None, 0.0)  # the boards as last read while every rank waited, and since when
        while self.pending:
            now = self.clock.elapsed()  # read once a look: it reads every process's schedstat
            left = self.timeout - now
            if grace_end is not None:
                left = min(left, grace_end - now)
            if left <= 0:
                break
            ready = wait([self.conns[r] for r in self.pending], timeout=min(left, _POLL))
            # A process's end too, not only its pipe's: a daemon it forked may hold the pipe open.
            ended = [r for r in self.pending if not self.procs[r].is_alive()]
            for rank in {rank_of[id(conn)] for conn in ready} | set(ended):
                kept.append(self._receive(rank, self.conns[rank]))
            if (self.reports or self.ended) and grace_end is None:
                grace_end = self.clock.elapsed() + _GRACE
            stuck = self._deadlock(now) if grace_end is None else None
            if stuck is not None:
                raise WorldFailed(stuck)
        # Every rank answered, and each worker can serve another call (course/runtime/worker.py's ANSWERED).
        self.reusable = not self.pending and all(kept)
        if self.reports or self.ended:
            self.ended += self._where_running()  # a rank that never reported: where it is
            limits = dataclasses.asdict(sandbox.LIMITS) if self.guard is not None else None
            raise WorldFailed(failure.diagnose(self.reports, self.ended, self.world_size, limits))
        if self.pending:
            raise WorldFailed(failure.timed_out(self._where_running(), self.world_size, self.timeout))
        return [self.results[r] for r in range(self.world_size)]

    def calls_made(self) -> dict | None:
        """What each rank's processes called of uprobes.ENTRIES since the counted call began (Observed's calls)."""
        if self.counted is None:
            return None
        return {key: count - self.counted[key] for key, count in self.counter.counts().items()}

    def loopback_sent(self) -> int | None:
        """What the world's loopback carried since its call began (Observed's loopback_bytes)."""
        return None if self.loopback is None else self.guard.loopback_bytes() - self.loopback

    def ended_call(self) -> bool:
        """Every rank answered: tell the workers to end what the call started (the call's process, and
        what it started), and wait until they have. Whether every one has."""
        try:
            for conn in self.conns:
                conn.send_bytes(b"end")
            waiting, end = list(self.conns), time.monotonic() + _ENDING
            while waiting and time.monotonic() < end:
                for conn in wait(waiting, timeout=end - time.monotonic()):
                    if conn.recv_bytes() != GONE:
                        return False
                    waiting.remove(conn)
            return not waiting  # a worker stopped (by the call, under "uid"): the world is stopped
        except (EOFError, OSError):
            return False

    def _boards(self) -> list | None:
        """Every rank's board, where every rank waits in something it says; else None."""
        boards = [read_board(board_path(self.stack_dir, r)) for r in range(self.world_size)]
        return boards if all(b is not None and b[1] is not None for b in boards) else None

    def _deadlock(self, now: float) -> failure.Failure | None:
        """A world where every rank waits, as its board has said for _STILL seconds, and no peer can
        ever answer any: nothing can move, whatever the time limit (course/runtime/failure.py's deadlock)."""
        boards = self._boards() if len(self.pending) == self.world_size else None
        if boards is None or boards != self.still[0]:
            self.still = (boards, now)
            return None
        if now - self.still[1] < _STILL:
            return None
        try:
            return failure.deadlock([record for _, record in boards], self.world_size)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):  # a board the rank's code overwrote
            return None

    def _receive(self, rank: int, conn) -> bool:
        """Take what a rank sent; whether its worker can serve another call."""
        self.pending.discard(rank)
        try:
            if not conn.poll(0):  # the process ended and sent nothing
                raise EOFError
            data = conn.recv_bytes()
        except (EOFError, OSError):
            self.procs[rank].join(timeout=1)
            self._ended(rank, self.procs[rank].exitcode)
            return False
        # The worker's own word (course/runtime/worker.py): the call answered, and the worker serves
        # another call or ends; or the call's child ended without answering.
        kind, data = data[:1], data[1:]
        if kind == ENDED:  # its worker lives, and serves the next call in a process forked afresh (fresh)
            self._ended(rank, int(data))
            return True
        kept = kind == ANSWERED
        try:
            status, payload = torch.load(io.BytesIO(data), weights_only=True)
            if status == "ok":
                result, imported = payload["result"], set(payload["imported"])
        except Exception as exc:  # noqa: BLE001 - whatever a call sent, it is that rank's failure
            reason = (
                f"it sent something that is not data (tensors, numbers, strings, lists, dicts):"
                f" {type(exc).__name__}: {failure.first_line(str(exc))}"
            )
            self.ended.append(failure.ended_without_report(rank, None, "", reason, when=time.time()))
            return kept
        if status != "ok":
            self.reports.append(payload)
        else:
            self.results[rank] = result
            _needed.update(imported & set(env.ON_DEMAND_MODULES))
            self.needed.update(imported & set(env.CALL_MODULES))
        return kept

    def _ended(self, rank: int, exit_code: int | None) -> None:
        """A rank that ended without answering: its planned death (run's deaths), whose result is None, or its failure."""
        if rank in self.deaths and exit_code == -signal.SIGKILL:
            self.results[rank] = None
        else:
            self.ended.append(failure.ended_without_report(rank, exit_code, self._call_stack(rank), when=time.time()))

    def _stack_size(self, rank: int) -> int:
        path = os.path.join(self.stack_dir, f"rank{rank}.stack")
        return os.path.getsize(path) if os.path.exists(path) else 0

    def _call_stack(self, rank: int) -> str:
        """What the rank's stack file took during this call (a crash's dump): an earlier call's is not this one's."""
        return self._stack(rank, self.stacks_before.get(rank, 0))

    def _stack(self, rank: int, offset: int = 0) -> str:
        try:
            with open(os.path.join(self.stack_dir, f"rank{rank}.stack")) as f:
                f.seek(offset)
                return f.read()
        except OSError:
            return ""

    def _where_running(self) -> list:
        """Each running rank's own line, from the stack that faulthandler dumps on SIGUSR1; for a rank
        that runs code of its own, where it loops, from a second ask (course/runtime/instrument.py's Loops)."""
        running = sorted(self.pending)
        if not running:  # every rank reported: no dump to wait for (most failed checks)
            return []
        offsets = {r: self._stack_size(r) for r in running}
        boards = {r: read_board(board_path(self.stack_dir, r)) for r in running}  # to tell a rank that moves
        # faulthandler writes from a signal handler, thread by thread; give it a moment.
        self._ask(running, lambda r: failure.stack_frames(self._stack(r, offsets[r])), seconds=2.0)
        time.sleep(0.05)  # the rest of a dump that has begun
        facts = {r: failure.running(r, self._stack(r, offsets[r])) for r in running}
        spinning = [r for r, fact in facts.items() if fact.state == "running" and fact.file]
        if spinning:
            time.sleep(_LOOP_INTERVAL)
            # Written at the rank's next line of Python: none comes from a rank in a long call into C.
            self._ask(spinning, lambda r: failure.loop_frames(self._stack(r, offsets[r])), seconds=0.5)
            facts.update({r: failure.running(r, self._stack(r, offsets[r])) for r in spinning})
        for r in running:  # the collective it waits in, by its number: to tell a slow one from a mismatch
            board = read_board(board_path(self.stack_dir, r))
            facts[r].instance = failure.instance(board[1] if board else None)
            # Its board changed since before its stack was asked for (its generation, or a read of it that came in the
            # middle of a write): it was on its way.
            facts[r].moved = (board and board[0]) != (boards[r] and boards[r][0])
        return [facts[r] for r in running]

    def _ask(self, ranks: list, answered: Callable, seconds: float) -> None:
        """Ask ranks for their stacks (SIGUSR1); wait until each has answered(rank), at most seconds of the
        world's own time."""
        if not hasattr(signal, "SIGUSR1"):
            return
        for rank in ranks:
            if self.procs[rank].is_alive():
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
        # Seconds of the world's own time: a rank starved of a CPU answers late, not never (OwnTime).
        clock = self.clock or OwnTime([p.pid for p in self.procs if p.pid])
        end = clock.elapsed() + seconds
        # A rank that ended cannot answer (one that had not yet set its handler dies of the signal).
        while clock.elapsed() < end and not all(answered(r) or not self.procs[r].is_alive() for r in ranks):
            time.sleep(0.02)

    def interrupted(self) -> None:
        """Ctrl-C: where each rank was, then KeyboardInterrupt carrying it."""
        self.pending = {r for r in range(len(self.procs)) if r not in self.results}
        facts = self._where_running() if self.procs else []
        # from None: where this process was when Ctrl-C came says nothing, and a test runner's report of
        # it (pytest's, every frame's source parsed) cost a grade seconds under load.
        raise Interrupted(failure.timed_out(facts, self.world_size, 0, interrupted=True)) from None

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    @ctrl_c_held()
    def stop(self) -> None:
        """Stop every process this world started: workers, what they started, and their orphans."""
        workers = [p.pid for p in self.procs if p.pid]
        parents = processes()
        started = descendants(workers, parents)
        kill(started)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=30)  # killed: it ends for certain, in seconds on a loaded machine (processes.reap)
        if self.guard is not None:
            self.guard.stop()  # under "uid", whatever of its uid still runs: a daemon that outruns snapshots too
        with _live_lock:
            _live.difference_update(workers)
            keep = self.children_before | _live | _own_helpers()
        orphans = [p for p, parent in processes().items() if parent == os.getpid() and p not in keep]
        kill(orphans)
        reap(set(started) | set(orphans))
        for conn in self.conns:
            conn.close()
        if self.counter is not None:
            self.counter.close()
        shutil.rmtree(self.stack_dir, ignore_errors=True)


class _Kept:
    """The worlds kept for later calls, by settings; the least recently used goes first."""

    # World sizes 1 to 4 (or a size with and without collectives checked), and the reference worlds of 2 and 3
    # (run(..., reference=True)): with 4, the checks of exercises 4, 10, 11 and 13 to 15 in one process started
    # 10 worlds instead of 6 (4 before there were reference worlds), each stopping another.
    MOST = 6

    def __init__(self):
        self.worlds: dict = {}
        self.owner = os.getpid()

    def _mine(self) -> None:
        if self.owner != os.getpid():  # a forked copy of the process that kept them: not ours to use
            for world in self.worlds.values():
                for conn in world.conns:
                    conn.close()
                if world.guard is not None:
                    world.guard.forget()
            self.worlds, self.owner = {}, os.getpid()

    def take(self, key) -> _World | None:
        self._mine()
        world = self.worlds.pop(key, None)
        if world is not None and not world.alive():
            world.stop()
            world = None
        return world

    def put(self, key, world: _World) -> None:
        self._mine()
        self.worlds[key] = world
        while len(self.worlds) > self.MOST:
            self.worlds.pop(next(iter(self.worlds))).stop()

    @ctrl_c_held()
    def stop(self) -> None:
        self._mine()
        while self.worlds:
            self.worlds.popitem()[1].stop()

    def pids(self) -> list:
        self._mine()
        return [proc.pid for world in self.worlds.values() for proc in world.procs]

    def holders(self) -> list:
        """The pids of the processes that hold the kept worlds' namespaces (course/runtime/sandbox.py's Guard)."""
        self._mine()
        guards = [world.guard for world in self.worlds.values() if world.guard is not None]
        return [guard.holder for guard in guards]


_kept = _Kept()
atexit.register(_kept.stop)


def stop_kept() -> None:
    """End the workers of every kept world now (they end with this process anyway)."""
    _kept.stop()


def kept_workers() -> list:
    """The pids of the kept worlds' workers: alive between calls, by design."""
    return _kept.pids()


def kept_processes() -> list:
    """The pids of every process of the kept worlds that this process started: their workers, and
    the process that holds each sandboxed world's namespaces."""
    return [*_kept.pids(), *_kept.holders()]


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a world; ``failure`` says where each rank was."""

    def __init__(self, failure: failure.Failure):
        super().__init__(failure.report())
        self.failure = failure
