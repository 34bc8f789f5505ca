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

``run`` starts CPU workers with gloo unless told otherwise; with ``backend="nccl",
device="cuda"`` rank r computes on cuda:r.

``launch`` is the same for scripts: it prints the diagnosis instead of raising, chooses the device
and backend (a GPU per rank and nccl where there are enough GPUs, else the CPU and gloo), and joins
the world of a cluster launcher (torchrun, srun, mpiexec) when this process was started by one.
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
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from course import env
from course.device import bound_device, select as select_device

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
    device: str  # "cpu", or "cuda": rank r takes cuda:r
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
        gpus = torch.cuda.device_count() if settings.device == "cuda" else 0
        select_device(env.choose_device(settings.device, settings.backend, rank, gpus, settings.world_size))
        dist.init_process_group(
            settings.backend,
            store=_store(settings, rank),
            rank=rank,
            world_size=settings.world_size,
            timeout=timedelta(seconds=settings.collective_timeout),
            device_id=bound_device(settings.backend),
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
# A collective that not every rank joined: gloo's own timeout, or, with collectives checked,
# the checking group's barrier before it.
_WAITED = ("Timed out", "failed to pass monitoredBarrier")


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
    if all(any(m in r.message for m in _WAITED) for r in reports if not _is_secondary(r)):
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
    device: str = "cpu",
    start_method: Optional[str] = None,
    debug: Optional[bool] = None,
    port: Optional[int] = None,
) -> list:
    """Run ``fn(*args)`` on every rank of a new world; return the results by rank.

    Raises WorldFailed when any rank fails, when the world runs past ``timeout`` seconds, or when
    ranks call mismatched collectives (with ``debug``). Defaults come from COURSE_TIMEOUT (600 s),
    COURSE_COLLECTIVE_TIMEOUT (60 s) and COURSE_DEBUG (set: check collectives). ``device`` is
    "cpu" or "cuda" (rank r on cuda:r); course.device.current_device() tells each rank its own.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    env.choose_backend(backend, device)  # refuses nccl for CPU tensors before any worker starts
    timeout = timeout if timeout is not None else _seconds_from_env("COURSE_TIMEOUT", 600)
    collective_timeout = (
        collective_timeout if collective_timeout is not None else _seconds_from_env("COURSE_COLLECTIVE_TIMEOUT", 60)
    )
    debug = debug if debug is not None else bool(os.environ.get("COURSE_DEBUG"))
    threads = env.threads_per_worker(world_size, env.usable_cores())
    method = start_method or env.default_start_method(sys.platform, threads, torch.cuda.is_initialized(), device)
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
        world_size, threads, backend, device, os.path.join(workdir, "store"), port, workdir, collective_timeout, child_env
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


def launch(
    fn: Callable,
    world_size: int,
    *args: Any,
    single_process: bool = False,
    port: Optional[int] = None,
    master_addr: Optional[str] = None,
    backend: Optional[str] = None,
    device: Optional[str] = None,
    **kwargs: Any,
) -> list:
    """``run`` for scripts: print the diagnosis and exit non-zero instead of raising.

    ``device`` and ``backend`` (--device, --backend) default to a GPU of its own for every rank
    and nccl where this machine has enough GPUs, else the CPU and gloo. With ``single_process``,
    a world of one runs ``fn`` here without a process group.

    Under torchrun, srun or mpiexec this process is already one rank of a world: it joins that
    world and runs ``fn`` here, whatever ``world_size`` and ``single_process`` say (the
    launcher's world size wins; rank 0 notes a difference). Only rank 0 returns, with ``[its
    result]``; the other ranks exit here, so what the script does with the results happens once.
    """
    outside = env.external_world()
    try:
        if outside is not None:
            return _run_in_external_world(fn, args, outside, world_size, master_addr, port, backend, device)
        # Asked for the highest local rank: when it has a GPU of its own, every rank has.
        where, backend = _choose(device, backend, world_size - 1, world_size, speak=True)
        if single_process and world_size == 1:
            select_device(where)
            return [fn(*args)]
        return run(fn, world_size, *args, port=port, backend=backend, device=where.partition(":")[0], **kwargs)
    except NotImplementedError as stub:  # a TODO not done yet: its message says which and where
        print(stub, file=sys.stderr)
        raise SystemExit(1)
    except WorldFailed as failure:
        print(failure.summary, file=sys.stderr)
        raise SystemExit(1)
    except KeyboardInterrupt:
        if outside is None:  # a cluster launcher stops its own ranks and says so
            print(f"\nInterrupted: stopped all {world_size} workers.", file=sys.stderr)
        # The workers are gone (run's finally). Skip the interpreter's teardown: after Ctrl-C
        # the script has nothing left to do, and a full-suite run saw it fail to exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)


def add_launch_arguments(parser) -> None:
    """The command-line flags of ``launch``: where the ranks meet and what they compute on."""
    group = parser.add_argument_group("where the ranks run (see docs/instructors.md)")
    group.add_argument("--port", type=int, default=None,
                       help="TCP port where the ranks meet (default: a private file for a local world;"
                       f" MASTER_PORT or {env.DEFAULT_PORT} under srun or mpiexec)")
    group.add_argument("--master-addr", default=None,
                       help="host of rank 0 under srun or mpiexec (default: MASTER_ADDR, else srun's first node,"
                       " else 127.0.0.1 when all ranks are on this machine)")
    group.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                       help="default: nccl when every rank has a GPU of its own, else gloo")
    group.add_argument("--device", default=None,
                       help="cpu, cuda or cuda:N (default: GPU r for local rank r when there are enough GPUs, else cpu)")


def launch_options(args) -> dict:
    """The keyword arguments of ``launch`` from flags parsed with add_launch_arguments."""
    return dict(port=args.port, master_addr=args.master_addr, backend=args.backend, device=args.device)


@contextmanager
def _settings_or_exit():
    """A setting that cannot work (course.env raises ValueError) stops the script with its reason."""
    try:
        yield
    except ValueError as reason:
        print(f"Cannot start: {reason}.", file=sys.stderr)
        raise SystemExit(2)


def _choose(device: Optional[str], backend: Optional[str], local_rank: int, ranks_here: Optional[int], speak: bool) -> tuple:
    """This rank's device and the world's backend; ``speak``: say why visible GPUs go unused."""
    gpus = torch.cuda.device_count()
    with _settings_or_exit():
        where = env.choose_device(device, backend, local_rank, gpus, ranks_here)
        chosen = env.choose_backend(backend, where)
    if speak and gpus and where == "cpu" and device is None and backend is None:
        print(f"note: {ranks_here} ranks on this machine and {gpus} GPU(s): every rank computes on the CPU"
              " (each needs a GPU of its own; --device cuda insists)", file=sys.stderr)
    return where, chosen


def _run_in_external_world(
    fn: Callable, args: tuple, world: env.ExternalWorld, world_size: int,
    master_addr: Optional[str], port: Optional[int], backend: Optional[str], device: Optional[str],
) -> list:
    with _settings_or_exit():
        addr, port = env.rendezvous(world, os.environ, master_addr, port)
    speak = world.rank == 0
    where, backend = _choose(device, backend, world.local_rank, world.local_world_size, speak)
    if speak and world_size != world.world_size:
        print(f"note: {world.launcher} started {world.world_size} ranks; --world-size {world_size} does not apply",
              file=sys.stderr)
    # The names torchrun sets, for env:// below and for code that reads os.environ["RANK"].
    os.environ.update(RANK=str(world.rank), WORLD_SIZE=str(world.world_size), LOCAL_RANK=str(world.local_rank),
                      MASTER_ADDR=addr, MASTER_PORT=str(port))
    if addr in ("127.0.0.1", "localhost"):
        os.environ.update(env.loopback_settings(sys.platform))  # all ranks are here: loopback works everywhere
    select_device(where)
    limit = os.environ.get("COURSE_COLLECTIVE_TIMEOUT")
    dist.init_process_group(backend, init_method="env://", rank=world.rank, world_size=world.world_size,
                            timeout=timedelta(seconds=float(limit)) if limit else None, device_id=bound_device(backend))
    result = fn(*args)
    dist.barrier()  # as in a local world: a skipped collective shows up here, not as a hang
    dist.destroy_process_group()
    if world.rank != 0:
        raise SystemExit(0)
    return [result]
