"""Start a world of worker processes, run one function on every rank, and always come back.

``run(fn, world_size, *args)`` starts ``world_size`` processes, joins them into a
torch.distributed process group (gloo on CPU), calls ``fn(*args)`` on every rank and returns the
list of their return values, indexed by rank. It never hangs and never leaves a process behind:

- Rendezvous goes through a FileStore in a fresh temporary folder, so no port is chosen and two
  worlds started at the same moment cannot collide.
- Collectives time out after ``collective_timeout`` seconds; the whole world after ``timeout``.
- When a rank fails, the others are stopped and ``WorldFailed`` names the rank that failed first
  with its own traceback, not the "connection closed" errors that its peers see afterwards.
- With TORCH_DISTRIBUTED_DEBUG=DETAIL (``debug=True``) torch checks before every collective that
  all ranks call the same one, and the report shows what each rank called. Not with built-in DDP:
  its constructor segfaults on the checking process group (torch 2.13, CPU, seen here). Without
  it a mismatch is reported after ``collective_timeout``, with the collective each rank waited in.
- On a timeout, the report says which ranks were still running and where (their Python stacks).
- Workers ignore Ctrl-C (the parent stops them) and die with their parent (Linux).

``launch`` is the same for scripts: it prints the diagnosis instead of raising, and joins the
world of a cluster launcher (torchrun, srun, mpiexec) when this process was started by one.
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from course import env

MISMATCH_MARKER = "Detected mismatch between collectives"


def _seconds_from_env(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


@dataclass
class RankReport:
    """What one rank said when it failed."""

    rank: int
    when: float
    kind: str  # the exception's class name, or "exit" for a rank that died without a word
    message: str
    traceback: str = ""


@dataclass
class WorldFailed(RuntimeError):
    """A world that did not finish. ``first`` is the rank that went wrong before the others."""

    summary: str
    first: Optional[RankReport] = None
    reports: list = field(default_factory=list)
    running: list = field(default_factory=list)

    def __str__(self) -> str:
        return self.summary


@dataclass(frozen=True)
class _WorkerSettings:
    world_size: int
    threads: int
    backend: str
    store_path: str
    port: Optional[int]
    stack_dir: str
    collective_timeout: float
    env: dict


def _die_with_parent() -> None:
    """Ask Linux to kill this worker when the launching process dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _worker(fn: Callable, args: tuple, rank: int, settings: _WorkerSettings, conn) -> None:
    # Ctrl-C reaches every process in the terminal's group; only the parent acts on it, so the
    # student sees one message rather than a KeyboardInterrupt traceback from every rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    if hasattr(signal, "SIGUSR1"):
        stack_file = open(os.path.join(settings.stack_dir, f"rank{rank}.stack"), "w")
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        faulthandler.enable(file=stack_file)  # a crash (segfault, abort) leaves its stack too
    os.environ.update(settings.env)
    # The names torchrun sets, so code can ask os.environ["RANK"] as it would on a cluster.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(settings.world_size))
    dist.set_debug_level_from_env()  # torch read TORCH_DISTRIBUTED_DEBUG when it was imported
    torch.set_num_threads(settings.threads)
    try:
        dist.init_process_group(
            settings.backend,
            store=_store(settings, rank),
            rank=rank,
            world_size=settings.world_size,
            timeout=timedelta(seconds=settings.collective_timeout),
        )
        result = fn(*args)
        # A rank that skipped a collective arrives here while its peers wait inside that
        # collective: the barrier turns the silent hang into a reported mismatch.
        dist.barrier()
        dist.destroy_process_group()
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        report = RankReport(rank, time.time(), type(exc).__name__, str(exc), traceback.format_exc())
        conn.send_bytes(pickle.dumps(("error", report)))
        conn.close()
        os._exit(1)


def _store(settings: _WorkerSettings, rank: int):
    """Where the ranks meet: a file in the world's private folder, or a TCP port if one was asked for."""
    if settings.port is None:
        return dist.FileStore(settings.store_path, settings.world_size)
    return dist.TCPStore(
        "127.0.0.1", settings.port, settings.world_size, is_master=rank == 0,
        timeout=timedelta(seconds=settings.collective_timeout), use_libuv=env.libuv_available(),
    )


def _stack_of(stack_dir: str, rank: int) -> list:
    """The frames faulthandler dumped for a rank, innermost first, without the launcher's own."""
    try:
        with open(os.path.join(stack_dir, f"rank{rank}.stack")) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    frames = []
    for line in lines:
        if _LAUNCHER_FILE in line:
            break
        if line.strip().startswith("File "):
            frames.append(line.strip())
    return frames


_SECONDARY = ("Connection closed by peer", "Connection reset by peer")


def _is_secondary(report: RankReport) -> bool:
    """A peer's echo of another rank's failure: it lost the connection to a rank that stopped."""
    return any(marker in report.message for marker in _SECONDARY)


def _first_failure(reports: list) -> RankReport:
    """The root cause: a rank's own error before any peer's 'connection closed', earliest first.

    Timestamps alone are not enough: gloo may close a socket a moment before the Python
    exception on that rank is raised and stamped.
    """
    return min(reports, key=lambda r: (_is_secondary(r), r.when))


_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')
_LAUNCHER_FILE = os.path.abspath(__file__)


def _is_plumbing(path: str) -> bool:
    return path == _LAUNCHER_FILE or f"{os.sep}torch{os.sep}" in path or f"{os.sep}multiprocessing{os.sep}" in path


def _where(tb: str) -> str:
    """Where the student's code was: its innermost frame, or the launcher's closing barrier."""
    frames = [m.groupdict() for m in _FRAME.finditer(tb)]
    collective = next((f["func"] for f in reversed(frames) if f["path"].endswith("distributed_c10d.py")), None)
    own = [f for f in frames if not _is_plumbing(f["path"])]
    if own:
        f = own[-1]
        place = f'{os.path.basename(f["path"])}:{f["line"]} in {f["func"]}'
    else:
        place = "the end of the run (its function had returned)"
    return f"in {collective} at {place}" if collective else f"at {place}"


def _own_collective(report: RankReport) -> str:
    match = re.search(rf"Rank {report.rank} is running collective: CollectiveFingerPrint\((.*?)OpType=(\w+)(?:, TensorShape=(\[[^\]]*\]))?", report.message)
    if not match:
        return "a collective"
    shape = f" of shape {match.group(3)}" if match.group(3) else ""
    return f"{match.group(2)}{shape}"


def _summarize(reports: list, world_size: int) -> str:
    first = _first_failure(reports)
    if first.kind == "NotImplementedError":
        return first.message
    by_rank = sorted(reports, key=lambda r: r.rank)
    if any(MISMATCH_MARKER in r.message for r in reports):
        lines = [f"Ranks called different collectives (world of {world_size}):"]
        lines += [f"  rank {r.rank} called {_own_collective(r)} {_where(r.traceback)}" for r in by_rank]
        return "\n".join(lines)
    if all("Timed out" in r.message for r in reports if not _is_secondary(r)):
        lines = [
            f"Ranks {[r.rank for r in by_rank]} waited in a collective that not every rank joined: one rank "
            "skipped a collective or called a different one (COURSE_DEBUG=1 compares them on every call):"
        ]
        lines += [f"  rank {r.rank} waited {_where(r.traceback)}" for r in by_rank]
        return "\n".join(lines)
    others = sorted(r.rank for r in reports if r is not first)
    tail = f"\n(ranks {others} failed after it, most likely because rank {first.rank} stopped.)" if others else ""
    body = first.traceback.strip() or first.message
    return f"Rank {first.rank} of {world_size} failed first:\n{body}{tail}"


# A worker's first optimizer step imports torch._dynamo: 1.4 s on 2 cores, paid by every rank at
# once. Imported before forking (here, or in the forkserver), every worker starts with it.
_WORKER_MODULES = ["torch", "torch.distributed", "torch._dynamo", "course.launch"]


def _context(method: str):
    ctx = mp.get_context(method)
    if method == "fork":
        for name in _WORKER_MODULES:
            importlib.import_module(name)
    elif method == "forkserver":
        ctx.set_forkserver_preload(_WORKER_MODULES)
    return ctx


def run(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: Optional[float] = None,
    collective_timeout: Optional[float] = None,
    backend: str = "gloo",
    start_method: Optional[str] = None,
    debug: Optional[bool] = None,
    port: Optional[int] = None,
) -> list:
    """Run ``fn(*args)`` on every rank of a new world; return the results by rank.

    Raises WorldFailed when any rank fails, when the world runs past ``timeout`` seconds, or when
    ranks call mismatched collectives (with ``debug``). Defaults come from COURSE_TIMEOUT (600 s),
    COURSE_COLLECTIVE_TIMEOUT (60 s) and COURSE_DEBUG (set: check collectives).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    timeout = timeout if timeout is not None else _seconds_from_env("COURSE_TIMEOUT", 600)
    collective_timeout = (
        collective_timeout if collective_timeout is not None else _seconds_from_env("COURSE_COLLECTIVE_TIMEOUT", 60)
    )
    debug = debug if debug is not None else bool(os.environ.get("COURSE_DEBUG"))
    threads = env.threads_per_worker(world_size, env.usable_cores())
    method = start_method or env.default_start_method(sys.platform, threads, torch.cuda.is_initialized())
    ctx = _context(method)
    # Fork would accept anything; pickling here first makes every start method accept the same
    # functions: ones defined at the top level of an importable module (not in a notebook cell).
    try:
        pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(f"{fn!r} and its arguments must be picklable by reference: define it at the top level of a .py file ({exc})") from exc

    workdir = tempfile.mkdtemp(prefix="course-world-")
    child_env = env.loopback_settings(sys.platform)
    if debug:
        child_env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    settings = _WorkerSettings(
        world_size, threads, backend, os.path.join(workdir, "store"), port, workdir, collective_timeout, child_env
    )

    procs, conns = [], []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, args=(fn, args, rank, settings, writer), name=f"rank{rank}", daemon=True)
            proc.start()
            writer.close()  # the child holds the only write end: its exit reads as EOF here
            procs.append(proc)
            conns.append(reader)
        checked = child_env.get("TORCH_DISTRIBUTED_DEBUG", os.environ.get("TORCH_DISTRIBUTED_DEBUG")) == "DETAIL"
        return _collect(procs, conns, timeout, workdir, checked)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=5)
        shutil.rmtree(workdir, ignore_errors=True)


_DDP_FILE = os.path.join("nn", "parallel", "distributed.py")
_DDP_UNDER_DETAIL = (
    "Built-in DistributedDataParallel crashes when collectives are checked (COURSE_DEBUG or "
    "TORCH_DISTRIBUTED_DEBUG=DETAIL) in torch 2.13: run it without them."
)


def _collect(procs: list, conns: list, timeout: float, stack_dir: str, checked: bool) -> list:
    world_size = len(procs)
    results: dict[int, Any] = {}
    reports: list[RankReport] = []
    rank_of = {id(c): r for r, c in enumerate(conns)}
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout
    grace_end = None  # after a first failure, peers get a moment to report theirs

    while pending:
        end = deadline if grace_end is None else min(deadline, grace_end)
        ready = wait([conns[r] for r in pending], timeout=max(0.0, end - time.monotonic()))
        if not ready:
            break
        for conn in ready:
            rank = rank_of[id(conn)]
            pending.discard(rank)
            try:
                status, payload = pickle.loads(conn.recv_bytes())
            except EOFError:
                procs[rank].join(timeout=1)
                code = procs[rank].exitcode
                frames = _stack_of(stack_dir, rank)
                where = ", at (innermost first):\n" + "\n".join("  " + f for f in frames) if frames else ""
                message = f"rank {rank} died with exit code {code} without reporting{where}"
                if checked and any(_DDP_FILE in f for f in frames):
                    message += "\n" + _DDP_UNDER_DETAIL
                reports.append(RankReport(rank, time.time(), "exit", message))
                continue
            if status == "ok":
                results[rank] = payload
            else:
                reports.append(payload)
        if reports and grace_end is None:
            grace_end = time.monotonic() + 1.0

    if reports:
        raise WorldFailed(_summarize(reports, world_size), _first_failure(reports), reports, sorted(pending))
    if pending:
        raise _timed_out(procs, sorted(pending), timeout, stack_dir)
    return [results[r] for r in range(world_size)]


def _timed_out(procs: list, running: list, timeout: float, stack_dir: str) -> WorldFailed:
    if hasattr(signal, "SIGUSR1"):
        for rank in running:
            if procs[rank].is_alive():
                os.kill(procs[rank].pid, signal.SIGUSR1)
        time.sleep(0.2)  # faulthandler writes from a signal handler; give it a moment
    lines = [f"Timed out after {timeout:g} s: ranks {running} were still running."]
    for rank in running:
        frames = _stack_of(stack_dir, rank)
        if frames:
            lines.append(f"rank {rank} was at (innermost first):\n" + "\n".join("  " + f for f in frames))
    return WorldFailed("\n".join(lines), None, [], running)


def launch(fn: Callable, world_size: int, *args: Any, single_process: bool = False, **kwargs: Any) -> list:
    """``run`` for scripts: print the diagnosis and exit non-zero instead of raising.

    Under torchrun, srun or mpiexec this process is already one rank of a world: join it and run
    ``fn`` here. With ``single_process``, a world of one runs ``fn`` here without a process group.
    """
    outside = env.external_world()
    if outside is not None:
        return [_run_in_external_world(fn, args, outside, kwargs.get("backend", "gloo"))]
    try:
        if single_process and world_size == 1:
            return [fn(*args)]
        return run(fn, world_size, *args, **kwargs)
    except NotImplementedError as stub:  # a TODO not done yet: its message says which and where
        print(stub, file=sys.stderr)
        raise SystemExit(1)
    except WorldFailed as failure:
        print(failure.summary, file=sys.stderr)
        raise SystemExit(1)
    except KeyboardInterrupt:
        print(f"\nInterrupted: stopped all {world_size} workers.", file=sys.stderr)
        raise SystemExit(130)


def _run_in_external_world(fn: Callable, args: tuple, world: env.ExternalWorld, backend: str) -> Any:
    os.environ.setdefault("RANK", str(world.rank))
    os.environ.setdefault("WORLD_SIZE", str(world.world_size))
    os.environ.setdefault("LOCAL_RANK", str(world.local_rank))
    os.environ.setdefault("MASTER_ADDR", world.master_addr or "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(world.master_port or 29500))
    dist.init_process_group(backend, init_method="env://", rank=world.rank, world_size=world.world_size)
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()
