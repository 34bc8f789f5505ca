"""One rank of a world: what a worker process does from its start to its end (course/runtime/workers.py
starts them). It confines itself, then serves the calls it is sent, answering each with data. It runs
a call itself and keeps its process for the next only where the call left it as it found it
(Baseline); or, where a grade counts (fresh), it never runs one: each call runs in a child forked for
it, which joins a process group of its own and is gone, with all it started, before the next call.
No code under test ever ran in the process a fresh call is forked from, so no call finds what an
earlier one left: a check's probe replaced, torch patched, a thread, a timer, a descriptor."""

from __future__ import annotations

import _thread
import collections
import contextlib
import faulthandler
import importlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import random
import signal
import stat
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy
import torch
import torch.distributed as dist

from course import impl
from course.device import bound_device
from course.device import select as select_device
from course.runtime import compat, env, failure, sandbox
from course.runtime.instrument import Agreement, Board, Loops, PointToPoint, Waits
from course.runtime.processes import (
    as_data,
    descendants,
    drop_streams,
    kill,
    private_descriptors,
    send_streams,
    take_streams,
)


@dataclass(frozen=True)
class WorkerSettings:
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
    fresh: bool = False  # a kept world whose every call runs in a process forked for it (a grade for credit)


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


class Baseline:
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
        # What cannot be undone from here ends the world: a handler or timer set from C, a descriptor kept, and
        # threads past this rank's half of the world's share of processes: gloo's threads of each group a call made
        # stay (12 a call of exercise 16 on 4 ranks), and the world's uid may have sandbox.MOST_PROCESSES in all.
        if _signal_state() != self.signals or not _own_descriptors(self.descriptors, _outputs()):
            return False
        if 2 * self.world_size * len(os.listdir("/proc/self/task")) > sandbox.MOST_PROCESSES:
            return False
        return all(
            all(vars(o).get(name, _GONE) is value for name, value in saved.items()) for o, saved in self.attributes
        )


def worker(rank: int, settings: WorkerSettings, conn) -> None:
    # Ctrl-C reaches every process in the terminal's group; only the parent acts on it, so the
    # student sees one message rather than a KeyboardInterrupt traceback from every rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sandbox.name_process(f"rank{rank}")  # not its parent's name: a world's processes are not the grader
    sandbox.die_with_parent()
    sandbox.adopt_orphans()  # a daemon the student starts stays ours, to be stopped
    stack_file = open(os.path.join(settings.stack_dir, f"rank{rank}.stack"), "w")
    board = Board(board_path(settings.stack_dir, rank))  # mapped: no descriptor to keep
    private_descriptors({conn.fileno(), stack_file.fileno()})
    drop_streams()  # until the first call brings its caller's
    if settings.reference:
        impl.refuse()
    # Before any code under test: under "namespaces" this process forks, and only the child returns.
    sandbox.confine(settings.sandbox, settings.guard, settings.stack_dir, settings.view)
    if settings.sandbox != "none":
        kept = env.for_workers(os.environ)  # an environment built for the world, not the grader's
        os.environ.clear()
        os.environ.update(kept)
        tempfile.tempdir = None  # TMPDIR is the world's own folder now (settings.env): read it again
        sandbox.protect()  # the calls it forks run as its user: none may trace it or read its memory
    faulthandler.enable(file=stack_file)  # a crash (segfault, abort) leaves its stack too
    os.environ.update(settings.env)
    # The names torchrun sets, so code can ask os.environ["RANK"] as it would on a cluster.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(settings.world_size))
    compat.quiet_renamed_collectives()
    messages = PointToPoint()
    messages.install()
    waits = Waits(rank, board, messages)
    waits.install()
    torch.set_num_threads(settings.threads)
    calls = _Calls(rank, settings, messages, waits, Loops(stack_file))
    if settings.fresh:
        _warm_up(settings.threads)
        if hasattr(signal, "SIGUSR1"):
            signal.signal(signal.SIGUSR1, calls.hand_on)
    number = 0
    while True:
        try:
            call, needed = conn.recv_bytes(), conn.recv_bytes().decode().split()
            take_streams(conn)
        except (EOFError, OSError):  # the parent ended, or stopped keeping this world
            os._exit(0)
        number += 1
        if not settings.fresh:
            answer, kept = calls.shared(call, number)
            conn.send_bytes(answer)
            calls.ended()
            _end_descendants()
            sys.stdout.flush()
            sys.stderr.flush()
            if not kept:
                os._exit(0)
            drop_streams()
            continue
        conn.send_bytes(calls.forked(call, number))
        try:
            conn.recv_bytes()  # the parent's word that every rank has answered: no peer needs the call's processes
        except (EOFError, OSError):
            os._exit(0)
        _end_descendants(calls.child)
        calls.child = 0
        with contextlib.suppress(OSError):  # the call's rendezvous, which no later call reads
            os.unlink(f"{settings.store_path}.{number}")
        drop_streams()
        conn.send_bytes(GONE)
        # What the next call's child should find imported: the probe's module (the call, unpickled
        # here, where no code under test runs), and what the world's calls have needed.
        with contextlib.suppress(Exception):
            pickle.loads(call)
        for name in set(needed) & set(env.CALL_MODULES):
            importlib.import_module(name)
        _reap()  # what the call's end killed, before a new child is forked
        calls.prepare(number + 1)


def _warm_up(threads: int) -> None:
    """Run here, once, what most calls run first in their process (a model's forward and backward, an
    optimizer's step), so that torch's first-time costs (lazy imports, caches) are paid once a world
    rather than once a call. In one thread: no OpenMP pool that a forked child could not use. The
    random state is left as it was."""
    state = torch.random.get_rng_state()
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    # An optimizer's first step imports torch._dynamo: only where this process has it already.
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)] if "torch._dynamo" in sys.modules else []
    for optimizer in [None, *optimizers]:
        loss = torch.nn.functional.cross_entropy(model(torch.randn(5, 4)), torch.tensor([0, 1, 2, 0, 1]))
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
    torch.set_num_threads(threads)
    torch.random.set_rng_state(state)


# What a call's answer to the parent starts with: data follows, and the worker serves another call
# (ANSWERED) or ends (DROPPED); or the call's process ended without answering, its exit status follows.
ANSWERED, DROPPED, ENDED = b"A", b"D", b"E"
GONE = b"G"  # a fresh call's end, told the parent: nothing of the call runs any more


@dataclass
class _Calls:
    """The calls of one rank. In its own process (shared): a world not kept, or a kept one whose calls
    share their worker's process, which serves the next call where the call left it as it found it
    (Baseline); or each in a child of its own, forked and joined to the world before its call comes
    (prepare, then forked: the fork and the rendezvous take place while the parent judges the call
    before), where the worker never runs a call (fresh)."""

    rank: int
    settings: WorkerSettings
    messages: PointToPoint
    waits: Waits
    loops: Loops
    child: int = 0  # the pid of the child that runs, or will run, the next call
    link: Any = None  # the pipe to it
    baseline: Any = None  # what the first shared call found
    tear_down: bool = False  # the last shared call returned, and its world is not kept

    def shared(self, call: bytes, number: int) -> tuple:
        """Run the call here; its answer, and whether this process can serve another call: it returned,
        or raised before it made a group or sent or started anything (a stub's NotImplementedError, after
        which no peer waits for this rank), and left the process as the first call found it."""
        self._answer_asks()
        if self.baseline is None:  # the world's first call
            try:
                self._join(number)
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
                return DROPPED + self._failed(exc), False
            self.baseline = Baseline()
        before = _traffic()
        answer, raised = self._run(call)
        clean = raised is None or (isinstance(raised, Exception) and before is not None and _traffic() == before)
        kept = self.settings.keep and clean and self.baseline.restored()
        self.tear_down = raised is None and not kept
        return (ANSWERED if kept else DROPPED) + answer, kept

    def ended(self) -> None:
        """After a shared call's answer: the process group of a call that returned, which no later call
        uses, is torn down (gloo takes about 20 ms: after the answer, so that no one waits for it). One
        whose call failed is not: a rank may still wait in it for a peer."""
        if self.tear_down:
            dist.destroy_process_group()

    def prepare(self, number: int) -> None:
        """Fork the child of call ``number``: it joins a process group of its own, then waits for the call."""
        here, there = multiprocessing.Pipe(duplex=True)  # a socket: the call's output travels on it
        parent = os.getpid()
        self.child = os.fork()
        if self.child == 0:
            sandbox.die_with_parent()  # the worker dies with the grader: so does the call it runs
            if os.getppid() != parent:  # it died before that
                os._exit(1)
            here.close()
            try:
                self._serve(there, number)
            finally:
                os._exit(0)
        there.close()
        self.link = here

    def forked(self, call: bytes, number: int) -> bytes:
        """Hand the call to its child; what it answered, or how it ended without answering. The
        child never holds this process's pipe to the parent: nothing it writes reaches the parent
        but its one answer."""
        if self.child == 0:
            self.prepare(number)
        link, self.link = self.link, None
        try:
            link.send_bytes(call)
            send_streams(link, self.child)
        except OSError:  # it ended already
            pass
        try:
            return self._read(link)
        finally:
            link.close()

    def _serve(self, link, number: int) -> None:
        self._answer_asks()
        try:
            self._join(number)
            failed = None
        except BaseException as exc:  # noqa: BLE001 - said when the call comes
            failed = exc
        try:
            call = link.recv_bytes()
            take_streams(link)
        except (EOFError, OSError):  # the world ends
            return
        link.send_bytes(ANSWERED + (self._failed(failed) if failed is not None else self._run(call)[0]))
        # Alive until every rank has answered (the worker then ends it): a peer may still read what this
        # rank sent, or connect to it, in a collective or a group this call made.
        with contextlib.suppress(EOFError, OSError):
            link.recv_bytes()

    def _read(self, link) -> bytes:
        ended = os.pidfd_open(self.child) if hasattr(os, "pidfd_open") else None
        try:
            while True:
                # The child's end, too: a process it started may hold the pipe open.
                ready = multiprocessing.connection.wait([link] + ([ended] if ended is not None else []), timeout=0.05)
                if link in ready:
                    try:
                        return link.recv_bytes()
                    except (EOFError, OSError):  # it ended without answering
                        pass
                pid, status = os.waitpid(self.child, os.WNOHANG)
                if pid:
                    self.child = 0  # reaped: its pid may be another process's from now on
                    return ENDED + str(os.waitstatus_to_exitcode(status)).encode()
        finally:
            if ended is not None:
                os.close(ended)

    def hand_on(self, signum, frame) -> None:
        """The parent's ask for the stack (SIGUSR1), for the call's child."""
        if self.child > 0:
            os.kill(self.child, signum)

    def _answer_asks(self) -> None:
        if hasattr(signal, "SIGUSR1"):  # the parent asks for the stack with it
            self.loops.install()

    def _join(self, number: int) -> None:
        settings = self.settings
        gpus = torch.cuda.device_count() if settings.device == "cuda" else 0
        select_device(
            env.choose_device(settings.device, settings.backend, self.rank, gpus, settings.world_size, same_gpus=True)
        )
        dist.init_process_group(
            settings.backend,
            store=store(settings, self.rank, number),
            rank=self.rank,
            world_size=settings.world_size,
            timeout=timedelta(seconds=settings.collective_timeout),
            device_id=bound_device(settings.backend),
        )
        if settings.compare:
            Agreement().install(timedelta(seconds=settings.collective_timeout))

    def _run(self, call: bytes) -> tuple:
        """Run the call in this process's group: what came of it, as data, and what it raised (None)."""
        try:
            fn, args, closing_barrier = pickle.loads(call)
            self.messages.clear()
            self.waits.clear()
            result = fn(*args)
            never_waited = self.messages.never_waited()
            if never_waited:
                unwaited = failure.unwaited_report(self.rank, time.time(), never_waited)
                return as_data(("error", unwaited)), RuntimeError("messages never waited for")
            # A rank that skipped a collective arrives here while its peers wait inside that
            # collective: the barrier turns the silent hang into a reported mismatch. Not where a death is
            # planned (workers.run's deaths): the dead rank would never come.
            if closing_barrier:
                dist.barrier()
            imported = [m for m in env.CALL_MODULES if m in sys.modules]
            return as_data(("ok", {"result": result, "imported": imported})), None
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
            return self._failed(exc), exc
        finally:
            sys.stdout.flush()
            sys.stderr.flush()

    def _failed(self, exc: BaseException) -> bytes:
        messages = self.messages
        report = failure.rank_report(
            self.rank, exc, time.time(), messages.waiting, self.waits.broken, messages.dropped()
        )
        return as_data(("error", report))


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


def _end_descendants(child: int = 0) -> None:
    """Kill every process this worker started (``child``, a call's, and what it started), and reap them;
    under "namespaces", those that have ended (the others, killed, run no line more: a later _reap)."""
    namespace = sandbox.in_own_namespace()  # every other process of the namespace is a descendant
    if namespace:
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)  # all at once: none can fork past it
        _reap()
        return
    if child:
        kill([child])
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, 0)  # killed, it ends for certain; its children are this process's now (a subreaper)
    try:
        others = os.waitpid(-1, os.WNOHANG)[0] == 0
    except ChildProcessError:  # none: no need to look through every process of the machine
        return
    if others:
        kill(descendants([os.getpid()]))
    _reap()


def _reap() -> None:
    """Reap the killed processes that have ended."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break


def board_path(folder: str, rank: int) -> str:
    """Where a rank says what it waits in (course/runtime/instrument.py's Board), in the grader's folder for its world."""
    return os.path.join(folder, f"rank{rank}.waits")


def store(settings: WorkerSettings, rank: int, number: int):
    """Where the ranks meet for call ``number``: a file of its own in the world's private folder, or a
    TCP port if one was asked for (a world of one call)."""
    if settings.port is None:
        return dist.FileStore(f"{settings.store_path}.{number}", settings.world_size)
    return dist.TCPStore(
        "127.0.0.1",
        settings.port,
        settings.world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=settings.collective_timeout),
        use_libuv=env.libuv_available(),
    )
