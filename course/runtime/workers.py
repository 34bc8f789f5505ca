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

What went wrong is diagnosed in course/runtime/failure.py; ``WorldFailed.failure`` carries it.
"""

from __future__ import annotations

import _thread
import atexit
import collections
import dataclasses
import faulthandler
import gc
import importlib
import io
import multiprocessing as mp
import os
import pickle
import random
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.connection import wait
from typing import Any

import numpy
import torch
import torch.distributed as dist

from course import impl
from course.device import bound_device
from course.device import select as select_device
from course.layout import ROOT
from course.runtime import compat, env, failure, sandbox
from course.runtime.instrument import (
    Agreement,
    Board,
    Loops,
    PointToPoint,
    Waits,
    read_board,
)


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


@dataclass(frozen=True)
class _WorkerSettings:
    world_size: int
    threads: int
    backend: str
    device: str  # "cpu", or "cuda": rank r takes cuda:r
    store_path: str
    port: int | None
    stack_dir: str
    collective_timeout: float
    env: dict
    keep: bool
    sandbox: str  # course/runtime/sandbox.py's level for this world: "uid", "namespaces" or "none"
    guard: Any = None  # what its workers need of the world's sandbox.Guard (its handle)
    view: tuple | None = None  # where grades are made: all its workers see (sandbox.view: the course, the code graded)
    reference: bool = False  # a world of this repository's code and torch only: it loads no code under test
    compare: bool = (
        False  # the ranks compare each collective before it starts (course/runtime/instrument.py's Agreement)
    )


# --- processes: die with the parent, and take descendants along -------------------------------

die_with_parent = sandbox.die_with_parent


def _processes() -> dict:
    """pid -> parent pid, from /proc (Linux; empty elsewhere)."""
    parents = {}
    if not os.path.isdir("/proc"):
        return parents
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return parents


def descendants(pids, parents: dict | None = None) -> list:
    parents = _processes() if parents is None else parents
    found, todo = [], list(pids)
    while todo:
        kids = [p for p, parent in parents.items() if parent == todo[-1]]
        todo.pop()
        found += kids
        todo += kids
    return found


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _reap(pids, seconds: float = 2.0) -> None:
    """Wait for killed processes that were (or became, as orphans) our children: no zombies."""
    todo, end = set(pids), time.monotonic() + seconds
    while todo and time.monotonic() < end:
        for pid in list(todo):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    todo.discard(pid)
            except ChildProcessError:  # not ours (yet: its parent is still dying), or gone
                if not os.path.exists(f"/proc/{pid}"):
                    todo.discard(pid)
        if todo:
            time.sleep(0.01)


_live_lock = threading.Lock()
_live: set = set()  # pids of the workers of every world now running in this process


def _own_helpers() -> set:
    """This process's long-lived children that are not a world's: the forkserver, mp's tracker."""
    from multiprocessing import forkserver, resource_tracker

    helpers = {forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid}
    return {p for p in helpers if p} | {c.pid for c in mp.active_children()}


# --- in the worker --------------------------------------------------------------------------

# Where a call's stdout and stderr go travels with the call, as descriptors (not on Windows, whose
# spawned workers write to the console they inherit): a kept worker writes where its caller's
# output goes now (a notebook cell's, a test's capture), not where it went when the world started.
_PASS_STREAMS = sys.platform != "win32"


def private_descriptors(keep: set) -> None:
    """Cut every descriptor inherited through fork but ``keep`` and 0, 1, 2 off what it reached
    (pytest-xdist's channel, the other ranks' pipes, the other kept worlds', a Jupyter kernel's
    output pipes, whose readers wait for every writer to close them).

    Each is pointed at /dev/null rather than closed: a Python file object inherited with it may
    still close it when collected, and must not close a descriptor that gloo opened since.
    """
    listing = next((d for d in ("/proc/self/fd", "/dev/fd") if os.path.isdir(d)), None)  # Linux, macOS
    inherited = [int(fd) for fd in os.listdir(listing) if int(fd) > 2 and int(fd) not in keep] if listing else []
    null = os.open(os.devnull, os.O_RDWR)
    for fd in inherited:
        if fd != null:
            try:
                os.dup2(null, fd, inheritable=False)
            except OSError:  # listdir's own descriptor, closed by now
                pass
    os.close(null)
    sys.unraisablehook = sys.__unraisablehook__  # not the test runner's, inherited through fork
    sys.stdin = open(os.devnull)
    # Whole lines, each in one write: two ranks never interleave mid-line.
    sys.stdout = open(1, "w", buffering=1, closefd=False, encoding="utf-8", errors="backslashreplace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, encoding="utf-8", errors="backslashreplace")


def _send(conn, message) -> None:
    buffer = io.BytesIO()
    torch.save(message, buffer)
    conn.send_bytes(buffer.getvalue())


def send_streams(conn, pid: int) -> None:
    """Hand the process at the other end of conn (a duplex Pipe) this process's stdout and stderr."""
    if _PASS_STREAMS:
        for fd in (1, 2):
            reduction.send_handle(conn, fd, pid)


def take_streams(conn) -> None:
    """Write, from now on, where send_streams's caller writes."""
    if _PASS_STREAMS:
        sys.stdout.flush()
        sys.stderr.flush()
        for target in (1, 2):
            fd = reduction.recv_handle(conn)
            os.dup2(fd, target)
            os.close(fd)


def drop_streams() -> None:
    """Write to the null device until take_streams: a process kept between calls must not hold its
    caller's output open (a Jupyter kernel waits at shutdown for every writer of its output to close it)."""
    if _PASS_STREAMS:
        sys.stdout.flush()
        sys.stderr.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        for target in (1, 2):
            os.dup2(null, target)
        os.close(null)


# What a call must leave as it found it for its world to be kept: a function of these replaced
# (a patched all_reduce, a wrapped Module.__call__) would reach the next call.
_WATCHED = ("torch", "torch.distributed", "torch.nn.functional", "torch.optim", "torch.nn.parallel")


def _watched() -> list:
    import torch.nn.parallel  # noqa: F401 - imported by torch.distributed's users anyway

    objects = [sys.modules[name] for name in _WATCHED] + [torch.Tensor, torch.nn.Module, torch.optim.Optimizer]
    objects.append(torch.nn.parallel.DistributedDataParallel)
    return [(o, dict(vars(o))) for o in objects]


_GONE = object()
_TIMERS = [getattr(signal, name) for name in ("ITIMER_REAL", "ITIMER_VIRTUAL", "ITIMER_PROF") if hasattr(signal, name)]


def _listing(folder: str) -> set:
    try:
        return set(os.listdir(folder))
    except OSError:  # not Linux
        return set()


def _descriptors() -> dict:
    """This process's open descriptors but stdout and stderr (each call's own): what each reaches
    (its type, device and inode)."""
    found = {}
    for fd in (_listing("/proc/self/fd") or _listing("/dev/fd")) - {"1", "2"}:
        try:
            st = os.fstat(int(fd))
        except OSError:  # the listing's own, closed by now
            continue
        found[int(fd)] = (stat.S_IFMT(st.st_mode), st.st_dev, st.st_ino)
    return found


def _outputs() -> set:
    """What this call's stdout and stderr reach."""
    return {(st.st_dev, st.st_ino) for st in map(os.fstat, (1, 2))}


def _own_descriptors(first: dict, outputs: set) -> bool:
    """Whether every descriptor but stdout and stderr is the world's own: one its first call found,
    or one of those a process group opens (a socket, a pipe with both ends here, an epoll's, which
    reach nothing outside the world); and none reaches this call's output, which a descriptor kept
    would write into after the call (a notebook kernel's, say)."""
    now = _descriptors()
    held = collections.Counter(now.values())
    for fd, what in now.items():
        if what[1:] in outputs:
            return False
        own = what[0] in (stat.S_IFSOCK, 0) or (what[0] == stat.S_IFIFO and held[what] == 2)
        if first.get(fd) != what and not own:
            return False
    return True


def _signal_state() -> list:
    """What the kernel holds of this process's signals and timers, beyond Python's handlers: the
    signals caught, ignored and blocked (handlers set from C, a mask) and its POSIX timers (Linux)."""
    found = []
    for path, kept in (("/proc/self/status", ("SigBlk", "SigIgn", "SigCgt")), ("/proc/self/timers", "")):
        try:
            with open(path) as f:
                found += [line for line in f if line.startswith(kept)]
        except OSError:  # not Linux, or a kernel without the timers' listing
            pass
    return found


class _Baseline:
    """What a kept worker's first call found: restored after each call, then checked."""

    def __init__(self):
        self.environ, self.cwd, self.path = dict(os.environ), os.getcwd(), list(sys.path)
        self.rng = torch.random.get_rng_state(), random.getstate(), numpy.random.get_state()
        self.threads, self.dtype = torch.get_num_threads(), torch.get_default_dtype()
        self.python_threads = set(threading.enumerate())
        # Every thread that Python started, or that runs Python, threading's or not.
        self.started, self.running = _thread._count(), set(sys._current_frames())
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.attributes = _watched()
        self.handlers = {s: signal.getsignal(s) for s in signal.valid_signals() if signal.getsignal(s) is not None}
        self.mask = signal.pthread_sigmask(signal.SIG_BLOCK, []) if hasattr(signal, "pthread_sigmask") else None
        self.descriptors, self.signals = _descriptors(), _signal_state()

    def restored(self) -> bool:
        """Restore what a call may change; whether the rest is as the first call found it."""
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        torch.random.set_rng_state(self.rng[0])
        random.setstate(self.rng[1])
        numpy.random.set_state(self.rng[2])
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        # Timers first: a timer's signal after its handler is restored would find the default (an exit).
        for timer in _TIMERS:
            signal.setitimer(timer, 0)
        for signum, handler in self.handlers.items():
            if signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)
        if self.mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)
        for folder in impl.loaded():  # the code under test is read again, as in a new worker
            impl.forget(folder)
        if not (dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) == (self.rank, self.world_size)):
            return False
        if not set(threading.enumerate()) <= self.python_threads:
            return False
        if _thread._count() > self.started or not set(sys._current_frames()) <= self.running:
            return False
        # What cannot be undone from here ends the world: a handler or timer set from C, a descriptor kept.
        if _signal_state() != self.signals or not _own_descriptors(self.descriptors, _outputs()):
            return False
        return all(
            all(vars(o).get(name, _GONE) is value for name, value in saved.items()) for o, saved in self.attributes
        )


def _worker(rank: int, settings: _WorkerSettings, conn) -> None:
    # Ctrl-C reaches every process in the terminal's group; only the parent acts on it, so the
    # student sees one message rather than a KeyboardInterrupt traceback from every rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    sandbox.adopt_orphans()  # a daemon the student starts stays ours, to be stopped
    stack_file = open(os.path.join(settings.stack_dir, f"rank{rank}.stack"), "w")
    board = Board(_board(settings.stack_dir, rank))  # mapped: no descriptor to keep
    private_descriptors({conn.fileno(), stack_file.fileno()})
    drop_streams()  # until the first call brings its caller's
    if settings.reference:
        impl.refuse()
    # Before any code under test: under "namespaces" this process forks, and only the child returns.
    sandbox.confine(settings.sandbox, settings.guard, settings.stack_dir, settings.view)
    if settings.sandbox != "none":
        tempfile.tempdir = None  # TMPDIR is the world's folder now (settings.env): read it again
    faulthandler.enable(file=stack_file)  # a crash (segfault, abort) leaves its stack too
    os.environ.update(settings.env)
    # The names torchrun sets, so code can ask os.environ["RANK"] as it would on a cluster.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(settings.world_size))
    compat.quiet_renamed_collectives()
    messages = PointToPoint()
    messages.install()
    waits = Waits(rank, board, messages)
    waits.install()
    loops = Loops(stack_file)
    torch.set_num_threads(settings.threads)
    baseline = None
    while True:
        try:
            fn, args = pickle.loads(conn.recv_bytes())
            take_streams(conn)
        except (EOFError, OSError):  # the parent ended, or stopped keeping this world
            os._exit(0)
        if hasattr(signal, "SIGUSR1"):  # the parent asks for the stack with it
            loops.install()
        code, kept, before = 1, False, None
        try:
            if baseline is None:  # the world's first call
                gpus = torch.cuda.device_count() if settings.device == "cuda" else 0
                select_device(
                    env.choose_device(
                        settings.device, settings.backend, rank, gpus, settings.world_size, same_gpus=True
                    )
                )
                dist.init_process_group(
                    settings.backend,
                    store=_store(settings, rank),
                    rank=rank,
                    world_size=settings.world_size,
                    timeout=timedelta(seconds=settings.collective_timeout),
                    device_id=bound_device(settings.backend),
                )
                if settings.compare:
                    Agreement().install(timedelta(seconds=settings.collective_timeout))
                baseline = _Baseline()
            messages.pending.clear()
            messages.waiting = None
            waits.clear()
            before = _traffic()
            result = fn(*args)
            never_waited = messages.never_waited()
            if never_waited:
                _send(conn, ("error", failure.unwaited_report(rank, time.time(), never_waited), False))
            else:
                # A rank that skipped a collective arrives here while its peers wait inside that
                # collective: the barrier turns the silent hang into a reported mismatch.
                dist.barrier()
                kept = settings.keep and baseline.restored()
                imported = [m for m in env.ON_DEMAND_MODULES if m in sys.modules]
                _send(conn, ("ok", {"result": result, "imported": imported}, kept))
                code = 0
                if not kept:
                    # gloo takes about 20 ms to tear a group down: after the result, so that no one
                    # waits for it (the parent stops the world as soon as every rank has answered).
                    dist.destroy_process_group()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
            report = failure.rank_report(rank, exc, time.time(), messages.waiting, waits.broken, messages.dropped())
            # An exception raised before the rank made a group or sent anything (a stub's
            # NotImplementedError) leaves no peer waiting for it: where every rank's is such, the
            # parent keeps the world (_World.collect).
            if settings.keep and isinstance(exc, Exception) and before is not None and _traffic() == before:
                kept = baseline.restored()
            _send(conn, ("error", report, kept))
        finally:
            _end_descendants()
            sys.stdout.flush()
            sys.stderr.flush()
            if not kept:
                os._exit(code)
            drop_streams()


def _traffic() -> tuple | None:
    """How many groups this rank has made, and the sequence number of each (torch counts every
    collective and message of a group in it, barriers and monitored ones too); None where torch
    cannot say."""
    c10d = dist.distributed_c10d
    try:
        return c10d._world.group_count, tuple(g._get_sequence_number_for_group() for g in list(c10d._world.pg_map))
    except Exception:  # noqa: BLE001 - a backend without sequence numbers: no call is taken for clean
        return None


def _end_descendants() -> None:
    """Kill every process this worker started, and reap them: a kept world starts each call clean."""
    if sandbox.in_own_namespace():  # every other process of the namespace is a descendant
        try:
            os.kill(-1, signal.SIGKILL)  # all at once: none can fork past it
        except ProcessLookupError:
            pass
    else:
        _kill(descendants([os.getpid()]))
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break


def _board(folder: str, rank: int) -> str:
    """Where a rank says what it waits in (course/runtime/instrument.py's Board), in its world's folder."""
    return os.path.join(folder, f"rank{rank}.waits")


def _store(settings: _WorkerSettings, rank: int):
    """Where the ranks meet: a file in the world's private folder, or a TCP port if one was asked for."""
    if settings.port is None:
        return dist.FileStore(settings.store_path, settings.world_size)
    return dist.TCPStore(
        "127.0.0.1",
        settings.port,
        settings.world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=settings.collective_timeout),
        use_libuv=env.libuv_available(),
    )


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


def stop_tree(pid: int, join: Callable | None = None) -> None:
    """Stop a child process and every process it started; reap them all. ``join``: how to wait
    for the child when a multiprocessing.Process started it (its join reaps it)."""
    started = descendants([pid])
    _kill([pid, *started])
    if join is None:
        os.waitpid(pid, 0)
    else:
        join()
    _reap(started)


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
) -> list:
    """Run ``fn(*args)`` on every rank of a new world; return the results by rank.

    Raises WorldFailed when any rank fails, when the world runs past ``timeout`` seconds, or when
    ranks call mismatched collectives (with ``debug``). Defaults come from COURSE_TIMEOUT (600 s),
    COURSE_COLLECTIVE_TIMEOUT (60 s, at most half the world's limit, so a rank stuck in a message
    is named before the world is stopped) and COURSE_DEBUG (set: check collectives). ``device``
    is "cpu" or "cuda" (rank r on cuda:r); course.device.current_device() tells each rank its own.
    Results must be data: tensors, numbers, strings, None, and lists, tuples and dicts of those.
    With ``keep``, a world kept by an earlier call with the same settings runs it (module docstring).
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
        call = pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(
            f"{fn!r} and its arguments must be picklable by reference: define it at the top level of a .py file ({exc})"
        ) from exc
    child_env = env.loopback_settings(sys.platform)
    level = sandbox_level() if (sandbox or _every_world_sandboxed) and not reference else None
    confinement = level.name if level else "none"
    # Where grades are made, the workers see the course's public files and the code graded, no more.
    viewed = _every_world_sandboxed and confinement != "none" and not level.unseen
    view = submission_view() if viewed else None
    keep = keep and port is None and _PASS_STREAMS
    key = (world_size, threads, backend, device, collective_timeout, method, tuple(sorted(child_env.items())))
    key += (confinement, view, reference, debug)
    world = _kept.take(key) if keep else None
    try:
        if world is not None:
            try:
                world.call(call)
            except OSError:  # a kept worker ended while it waited (killed from outside)
                world.stop()
                world = None
        if world is None:
            settings = _WorkerSettings(
                world_size, threads, backend, device, "", port, "", collective_timeout, child_env, keep, confinement
            )
            # The comparison's exchanges are CPU tensors: gloo only (NCCL compares nothing, docs/design.md).
            compare = debug and backend == "gloo"
            world = _World.start(method, dataclasses.replace(settings, view=view, reference=reference, compare=compare))
            world.call(call)
        world.timeout = timeout
        try:
            return world.collect()
        finally:
            if world.reusable:
                _kept.put(key, world)
                world = None
    except KeyboardInterrupt:
        if world is None:  # while it started: start stopped what it had started
            raise
        world.interrupted()
    finally:
        if world is not None:
            world.stop()


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
        self.timeout = 0.0
        self.procs: list = []
        self.conns: list = []
        self.results: dict = {}
        self.reports: list = []
        self.ended: list = []
        self.pending: set = set()
        self.reusable = False

    @classmethod
    def start(cls, method: str, settings: _WorkerSettings) -> _World:
        """Start the ranks of settings in a private folder (its store and stack files)."""
        ctx = _context(method)
        _import_for_this_process()
        sandbox.adopt_orphans()  # a worker's orphans come here, to be stopped with the world
        workdir = tempfile.mkdtemp(prefix="course-world-")
        children = {p for p, parent in _processes().items() if parent == os.getpid()}
        world = cls(settings.world_size, workdir, children, None)
        try:
            settings = dataclasses.replace(settings, store_path=os.path.join(workdir, "store"), stack_dir=workdir)
            if settings.sandbox != "none":
                world.guard = sandbox.Guard.start(settings.sandbox)
                # The one folder made for the workers to write: HOME and TMPDIR too.
                tmp = os.path.join(workdir, "tmp")
                os.mkdir(tmp)
                for folder in (workdir, tmp):
                    world.guard.own(folder)
                extra = {"HOME": workdir, "TMPDIR": tmp}
                if settings.view is not None:
                    sandbox.publish(workdir, settings.view)
                settings = dataclasses.replace(settings, env=settings.env | extra, guard=world.guard.handle)
        except BaseException:
            world.stop()
            raise
        world_size = settings.world_size
        _freeze_once()
        try:
            for rank in range(world_size):
                here, there = ctx.Pipe(duplex=True)  # a socket: descriptors travel on it (send_streams)
                proc = ctx.Process(target=_worker, args=(rank, settings, there), name=f"rank{rank}", daemon=True)
                with _live_lock:
                    proc.start()
                    _live.add(proc.pid)
                there.close()  # the child holds the only other end: its exit reads as EOF here
                world.procs.append(proc)
                world.conns.append(here)
        except BaseException:
            world.stop()
            raise
        return world

    def call(self, call: bytes) -> None:
        """Hand every rank the pickled (fn, args), and this process's stdout and stderr as they are now."""
        self.results, self.reports, self.ended, self.reusable = {}, [], [], False
        for proc, conn in zip(self.procs, self.conns):
            conn.send_bytes(call)
            send_streams(conn, proc.pid)

    def collect(self) -> list:
        rank_of = {id(c): r for r, c in enumerate(self.conns)}
        self.pending = set(range(self.world_size))
        deadline = time.monotonic() + self.timeout
        grace_end = None  # after a first failure, peers get a moment to report theirs
        kept = []
        self.still = (None, 0.0)  # the boards as last read while every rank waited, and since when
        while self.pending:
            end = deadline if grace_end is None else min(deadline, grace_end)
            left = end - time.monotonic()
            if left <= 0:
                break
            ready = wait([self.conns[r] for r in self.pending], timeout=min(left, _POLL))
            # A process's end too, not only its pipe's: a daemon it forked may hold the pipe open.
            ended = [r for r in self.pending if not self.procs[r].is_alive()]
            for rank in {rank_of[id(conn)] for conn in ready} | set(ended):
                kept.append(self._receive(rank, self.conns[rank]))
            if (self.reports or self.ended) and grace_end is None:
                grace_end = time.monotonic() + 1.0
            stuck = self._deadlock() if grace_end is None else None
            if stuck is not None:
                raise WorldFailed(stuck)
        # Every rank answered and can run another call: it returned, or every one raised before it sent anything.
        self.reusable = not self.pending and all(kept)
        if self.reports or self.ended:
            self.ended += self._where_running()  # a rank that never reported: where it is
            raise WorldFailed(failure.diagnose(self.reports, self.ended, self.world_size))
        if self.pending:
            raise WorldFailed(failure.timed_out(self._where_running(), self.world_size, self.timeout))
        return [self.results[r] for r in range(self.world_size)]

    def _boards(self) -> list | None:
        """Every rank's board, where every rank waits in something it says; else None."""
        boards = [read_board(_board(self.stack_dir, r)) for r in range(self.world_size)]
        return boards if all(b is not None and b[1] is not None for b in boards) else None

    def _deadlock(self) -> failure.Failure | None:
        """A world where every rank waits, as its board has said for _STILL seconds, and no peer can
        ever answer any: nothing can move, whatever the time limit (course/runtime/failure.py's deadlock)."""
        boards = self._boards() if len(self.pending) == self.world_size else None
        if boards is None or boards != self.still[0]:
            self.still = (boards, time.monotonic())
            return None
        if time.monotonic() - self.still[1] < _STILL:
            return None
        try:
            return failure.deadlock([record for _, record in boards], self.world_size)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):  # a board the rank's code overwrote
            return None

    def _receive(self, rank: int, conn) -> bool:
        """Take what a rank sent; whether it can run another call."""
        self.pending.discard(rank)
        try:
            if not conn.poll(0):  # the process ended and sent nothing
                raise EOFError
            data = conn.recv_bytes()
        except (EOFError, OSError):
            self.procs[rank].join(timeout=1)
            self.ended.append(
                failure.ended_without_report(rank, self.procs[rank].exitcode, self._stack(rank), when=time.time())
            )
            return False
        try:
            # kept: whether the rank can run another call (it returned, or raised before it sent anything)
            status, payload, kept = torch.load(io.BytesIO(data), weights_only=True)
            if status == "ok":
                result, imported = payload["result"], set(payload["imported"])
        except Exception as exc:  # noqa: BLE001 - whatever a worker sent, it is that rank's failure
            reason = (
                f"it sent something that is not data (tensors, numbers, strings, lists, dicts):"
                f" {type(exc).__name__}: {failure.first_line(str(exc))}"
            )
            self.ended.append(failure.ended_without_report(rank, None, "", reason, when=time.time()))
            return False
        if status != "ok":
            self.reports.append(payload)
        else:
            self.results[rank] = result
            _needed.update(imported & set(env.ON_DEMAND_MODULES))
        return kept is True

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
        offsets = {
            r: os.path.getsize(os.path.join(self.stack_dir, f"rank{r}.stack"))
            if os.path.exists(os.path.join(self.stack_dir, f"rank{r}.stack"))
            else 0
            for r in running
        }
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
            board = read_board(_board(self.stack_dir, r))
            facts[r].instance = failure.instance(board[1] if board else None)
        return [facts[r] for r in running]

    def _ask(self, ranks: list, answered: Callable, seconds: float) -> None:
        """Ask ranks for their stacks (SIGUSR1); wait until each has answered(rank), at most seconds."""
        if not hasattr(signal, "SIGUSR1"):
            return
        for rank in ranks:
            if self.procs[rank].is_alive():
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
        end = time.monotonic() + seconds
        while time.monotonic() < end and not all(answered(r) for r in ranks):
            time.sleep(0.02)

    def interrupted(self) -> None:
        """Ctrl-C: where each rank was, then KeyboardInterrupt carrying it."""
        self.pending = {r for r in range(len(self.procs)) if r not in self.results}
        facts = self._where_running() if self.procs else []
        raise Interrupted(failure.timed_out(facts, self.world_size, 0, interrupted=True))

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def stop(self) -> None:
        """Stop every process this world started: workers, what they started, and their orphans."""
        workers = [p.pid for p in self.procs if p.pid]
        parents = _processes()
        started = descendants(workers, parents)
        _kill(started)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5)
        if self.guard is not None:
            self.guard.stop()  # under "uid", whatever of its uid still runs: a daemon that outruns snapshots too
        with _live_lock:
            _live.difference_update(workers)
            keep = self.children_before | _live | _own_helpers()
        orphans = [p for p, parent in _processes().items() if parent == os.getpid() and p not in keep]
        _kill(orphans)
        _reap(set(started) | set(orphans))
        for conn in self.conns:
            conn.close()
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
