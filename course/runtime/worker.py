"""One rank of a world: what a worker process does from its start to its end (course/runtime/workers.py
starts them). It confines itself, joins the world's process group, runs each call it is sent and
answers with data, and keeps its process for the next call only where the call left it as it found it
(Baseline)."""

from __future__ import annotations

import _thread
import collections
import faulthandler
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
from course.runtime.processes import descendants, drop_streams, kill, private_descriptors, send, take_streams


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
        # What cannot be undone from here ends the world: a handler or timer set from C, a descriptor kept.
        if _signal_state() != self.signals or not _own_descriptors(self.descriptors, _outputs()):
            return False
        return all(
            all(vars(o).get(name, _GONE) is value for name, value in saved.items()) for o, saved in self.attributes
        )


def worker(rank: int, settings: WorkerSettings, conn) -> None:
    # Ctrl-C reaches every process in the terminal's group; only the parent acts on it, so the
    # student sees one message rather than a KeyboardInterrupt traceback from every rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
                    store=store(settings, rank),
                    rank=rank,
                    world_size=settings.world_size,
                    timeout=timedelta(seconds=settings.collective_timeout),
                    device_id=bound_device(settings.backend),
                )
                if settings.compare:
                    Agreement().install(timedelta(seconds=settings.collective_timeout))
                baseline = Baseline()
            messages.clear()
            waits.clear()
            before = _traffic()
            result = fn(*args)
            never_waited = messages.never_waited()
            if never_waited:
                send(conn, ("error", failure.unwaited_report(rank, time.time(), never_waited), False))
            else:
                # A rank that skipped a collective arrives here while its peers wait inside that
                # collective: the barrier turns the silent hang into a reported mismatch.
                dist.barrier()
                kept = settings.keep and baseline.restored()
                imported = [m for m in env.ON_DEMAND_MODULES if m in sys.modules]
                send(conn, ("ok", {"result": result, "imported": imported}, kept))
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
            send(conn, ("error", report, kept))
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
        kill(descendants([os.getpid()]))
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break


def board_path(folder: str, rank: int) -> str:
    """Where a rank says what it waits in (course/runtime/instrument.py's Board), in its world's folder."""
    return os.path.join(folder, f"rank{rank}.waits")


def store(settings: WorkerSettings, rank: int):
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
