"""Process plumbing for worlds of workers: finding and stopping a process and what it started,
cutting a forked worker off the descriptors it inherited, handing a call's output streams to it, and
where Ctrl-C may land while processes are forked and stopped. Linux gives the most (/proc); elsewhere
a process's own children only. It imports no torch: course/runtime/sandbox.py forks with it in
processes that never import torch (autograding's own)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import reduction


def processes() -> dict:
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
    parents = processes() if parents is None else parents
    found, todo = [], list(pids)
    while todo:
        kids = [p for p, parent in parents.items() if parent == todo[-1]]
        todo.pop()
        found += kids
        todo += kids
    return found


def kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def reap(pids, seconds: float = 30.0) -> None:
    """Wait for killed processes that were (or became, as orphans) our children: no zombies. A killed
    process ends for certain, but a loaded machine can take seconds to unmap a large one (a worker that
    imported torch): ``seconds`` only bounds a process the kernel cannot end (stuck in a device's I/O)."""
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


def waited_for_a_cpu(pid: int) -> float | None:
    """Seconds pid's main thread has been ready to run while others ran (Linux's schedstat); None
    where the platform does not say, or the process has ended."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class OwnTime:
    """The time a world has had to run: the wall time since it began, less the longest that any of
    its processes waited for a CPU. A world's limits are of its own time, so a loaded machine (the
    other jobs of a laptop, a class graded at once) slows a check down and never fails it; an endless
    loop still reaches its limit, in its own time. Where the kernel does not say (not Linux), the wall
    time. Never less than a quarter of the wall time (SLOWEST): a machine loaded past that stretches a
    limit four times at most, and a world starved of every CPU still ends."""

    SLOWEST = 4

    RESCAN = 1.0  # seconds between looks for the processes of the world (a sandbox's, a student's)

    def __init__(self, roots: list):
        self.roots, self.began = list(roots), time.monotonic()
        self.tree, self.scanned = list(roots), self.began
        self.waited: dict = {}  # pid -> seconds waited when first seen, and when last seen

    def elapsed(self) -> float:
        now = time.monotonic()
        if now - self.scanned >= self.RESCAN:
            self.tree, self.scanned = [*self.roots, *descendants(self.roots)], now
        for pid in self.tree:
            waited = waited_for_a_cpu(pid)
            if waited is not None:
                self.waited[pid] = (self.waited.get(pid, (waited,))[0], waited)
        lost = max((last - first for first, last in self.waited.values()), default=0.0)
        return max(now - self.began - lost, (now - self.began) / self.SLOWEST)


# Where a call's stdout and stderr go travels with the call, as descriptors (not on Windows, whose
# spawned workers write to the console they inherit): a kept worker writes where its caller's
# output goes now (a notebook cell's, a test's capture), not where it went when the world started.
PASS_STREAMS = sys.platform != "win32"


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


def as_data(message) -> bytes:
    """A message from a worker to its parent: torch.save's bytes, read back there with weights_only."""
    import torch

    buffer = io.BytesIO()
    torch.save(message, buffer)
    return buffer.getvalue()


def send_streams(conn, pid: int) -> None:
    """Hand the process at the other end of conn (a duplex Pipe) this process's stdout and stderr."""
    if PASS_STREAMS:
        for fd in (1, 2):
            reduction.send_handle(conn, fd, pid)


def take_streams(conn) -> None:
    """Write, from now on, where send_streams's caller writes."""
    if PASS_STREAMS:
        sys.stdout.flush()
        sys.stderr.flush()
        for target in (1, 2):
            fd = reduction.recv_handle(conn)
            os.dup2(fd, target)
            os.close(fd)


def drop_streams() -> None:
    """Write to the null device until take_streams: a process kept between calls must not hold its
    caller's output open (a Jupyter kernel waits at shutdown for every writer of its output to close it)."""
    if PASS_STREAMS:
        sys.stdout.flush()
        sys.stderr.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        for target in (1, 2):
            os.dup2(null, target)
        os.close(null)


@contextlib.contextmanager
def ctrl_c_held():
    """Ctrl-C (SIGINT) waits until the block ends, and is raised there; also a decorator.

    Around a fork (os.fork, multiprocessing's start): Python runs handlers at a fork (logging's
    lock), and a KeyboardInterrupt raised in one is printed and dropped (a grade lost its Ctrl-C so,
    under load, and went on to its table); and the child, until it ignores Ctrl-C as its first line,
    would die of it (a worker, failing its check). Here Ctrl-C is only noted, in the child as in this
    process, whichever of its threads the kernel gives it to. Around a stop: nothing is left half stopped.
    Where SIGINT has no handler of Python's (ignored, or left at the system's default), or outside the
    main thread (which alone runs Python's handlers), the block runs as it is.
    """
    handler = signal.getsignal(signal.SIGINT)
    if not callable(handler) or threading.current_thread() is not threading.main_thread():
        yield
        return
    came = []
    signal.signal(signal.SIGINT, lambda *_: came.append(True))
    forker = os.getpid()
    try:
        yield
    finally:
        if os.getpid() == forker:  # a child forked in the block keeps the note, until it ignores Ctrl-C
            signal.signal(signal.SIGINT, handler)
            if came:
                signal.raise_signal(signal.SIGINT)


@ctrl_c_held()
def stop_tree(pid: int, join: Callable | None = None) -> None:
    """Stop a child process and every process it started; reap them all. ``join``: how to wait
    for the child when a multiprocessing.Process started it (its join reaps it)."""
    started = descendants([pid])
    kill([pid, *started])
    if join is None:
        os.waitpid(pid, 0)
    else:
        join()
    reap(started)
