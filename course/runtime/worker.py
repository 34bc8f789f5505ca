"""One rank of a world: what a worker process does from its start to its end (course/runtime/workers.py
starts them). It confines itself and then serves calls, never running one itself where its world is
kept: each call runs in a child forked for it, which joins a process group of its own, runs the call,
answers with data and is gone, with all it started, before the next call is read. No code under test
ever ran in the process a call is forked from (its template), so no call finds what an earlier one
left: a check's probe replaced, torch patched, a thread, a timer, a signal handler, a descriptor."""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from course import impl
from course.device import bound_device
from course.device import select as select_device
from course.runtime import compat, env, failure, sandbox
from course.runtime.instrument import Agreement, Board, Loops, PointToPoint, Waits
from course.runtime.processes import descendants, drop_streams, kill, private_descriptors, send_streams, take_streams


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
        tempfile.tempdir = None  # TMPDIR is the world's folder now (settings.env): read it again
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
    if settings.keep and hasattr(signal, "SIGUSR1"):
        signal.signal(signal.SIGUSR1, calls.hand_on)
    number = 0
    while True:
        try:
            call, needed = conn.recv_bytes(), conn.recv_bytes().decode().split()
            take_streams(conn)
        except (EOFError, OSError):  # the parent ended, or stopped keeping this world
            os._exit(0)
        number += 1
        if not settings.keep:
            conn.send_bytes(calls.inline(call, number))
            _end_descendants()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
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
        conn.send_bytes(ENDED)  # nothing of the call runs any more
        # What the next call's child should find imported: the probe's module (the call, unpickled
        # here, where no code under test runs), and what the world's calls have needed.
        with contextlib.suppress(Exception):
            pickle.loads(call)
        for name in set(needed) & set(env.CALL_MODULES):
            importlib.import_module(name)
        calls.prepare(number + 1)


ANSWERED, ENDED = b"A", b"E"  # what a call's answer to the parent starts with: data follows, or an exit status


@dataclass
class _Calls:
    """The calls of one rank: run where they are asked (inline), or each in a child of its own, forked
    and joined to the world before its call comes (prepare, then forked): the fork and the rendezvous
    take place while the parent judges the call before."""

    rank: int
    settings: WorkerSettings
    messages: PointToPoint
    waits: Waits
    loops: Loops
    child: int = 0  # the pid of the child that runs, or will run, the next call
    link: Any = None  # the pipe to it

    def inline(self, call: bytes, number: int) -> bytes:
        self._answer_asks()
        try:
            self._join(number)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
            return self._failed(exc)
        return self._run(call)

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
        link.send_bytes(self._failed(failed) if failed is not None else self._run(call))
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

    def _run(self, call: bytes) -> bytes:
        """Run the call in this process's group; what came of it, as data."""
        try:
            fn, args = pickle.loads(call)
            self.messages.clear()
            self.waits.clear()
            result = fn(*args)
            never_waited = self.messages.never_waited()
            if never_waited:
                return _data(("error", failure.unwaited_report(self.rank, time.time(), never_waited)))
            # A rank that skipped a collective arrives here while its peers wait inside that
            # collective: the barrier turns the silent hang into a reported mismatch.
            dist.barrier()
            imported = [m for m in env.CALL_MODULES if m in sys.modules]
            return _data(("ok", {"result": result, "imported": imported}))
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
            return self._failed(exc)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()

    def _failed(self, exc: BaseException) -> bytes:
        messages = self.messages
        report = failure.rank_report(
            self.rank, exc, time.time(), messages.waiting, self.waits.broken, messages.dropped()
        )
        return _data(("error", report))


def _data(message) -> bytes:
    """A call's answer to the parent: torch.save's bytes, read back there with weights_only."""
    buffer = io.BytesIO()
    torch.save(message, buffer)
    return ANSWERED + buffer.getvalue()


def _end_descendants(child: int = 0) -> None:
    """Kill every process this worker started (``child``, a call's, and what it started), and reap them."""
    namespace = sandbox.in_own_namespace()  # every other process of the namespace is a descendant
    if namespace:
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)  # all at once: none can fork past it
    elif child:
        kill([child])
    if child:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, 0)  # killed, it ends for certain; its children are this process's now (a subreaper)
    try:
        others = not namespace and os.waitpid(-1, os.WNOHANG)[0] == 0
    except ChildProcessError:  # none: no need to look through every process of the machine
        return
    if others:
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
