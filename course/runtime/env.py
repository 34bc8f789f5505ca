"""Decisions taken from the environment, kept free of side effects so they can be unit-tested.

Every function here reads a mapping (normally ``os.environ``) and facts about the platform that
the caller passes in, and returns a plain value. ``course.launch`` applies them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class ExternalWorld:
    """A world started by a cluster launcher: this process is one of its ranks."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None  # ranks on this machine, where the launcher says


class _Launcher(NamedTuple):
    name: str
    rank: str  # the variables it sets: this process's rank,
    size: str  # the world size,
    local_rank: str  # the rank among the ranks on this machine,
    local_size: str | None  # and their number, where it says
    local_rank_required: bool = False  # match only where local_rank is set too


# In the order they are tried. torchrun sets RANK/WORLD_SIZE/...; OpenMPI's mpiexec
# OMPI_COMM_WORLD_*; MPICH and Intel MPI (Hydra) PMI_* and MPI_LOCAL*; srun SLURM_*.
# - MPI comes before SLURM because mpiexec inside a SLURM job inherits SLURM_* variables that
#   describe the job, not its own ranks.
# - MPICH needs MPI_LOCALRANKID as well: srun with SLURM's pmi2 plugin (--mpi=pmi2) sets PMI_RANK
#   and PMI_SIZE in every task but no MPI_LOCALRANKID, which Hydra always sets. Taken for MPICH,
#   those tasks would all get local rank 0 (the same GPU) and no node list to meet on.
# - SLURM_STEP_NUM_TASKS, not SLURM_NTASKS: only srun sets it, whereas an sbatch script itself
#   runs with SLURM_PROCID=0 and SLURM_NTASKS=N and would otherwise wait for N-1 ranks that never come.
_LAUNCHERS = (
    _Launcher("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    _Launcher(
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    _Launcher("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", local_rank_required=True),
    _Launcher("slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", None),
)

# The variables that make a process join a launcher's world (tests clear them: see conftest.py).
LAUNCHER_VARIABLES = tuple(name for launcher in _LAUNCHERS for name in (launcher.rank, launcher.size))

DEFAULT_PORT = 29500  # torch's customary MASTER_PORT


def external_world(environ: Mapping[str, str] = os.environ) -> ExternalWorld | None:
    """The world a cluster launcher put this process in, or None when we must start our own."""
    for launcher in _LAUNCHERS:
        required = (launcher.rank, launcher.size) + ((launcher.local_rank,) if launcher.local_rank_required else ())
        if all(name in environ for name in required):
            local_size = environ.get(launcher.local_size) if launcher.local_size else None
            return ExternalWorld(
                launcher=launcher.name,
                rank=int(environ[launcher.rank]),
                world_size=int(environ[launcher.size]),
                local_rank=int(environ.get(launcher.local_rank, 0)),
                local_world_size=int(local_size) if local_size else None,
            )
    return None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[07-09,12],cpu01' gives 'gpu07'."""
    depth = 0
    for end, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            nodelist = nodelist[:end]
            break
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], nodelist)


def rendezvous(
    world: ExternalWorld,
    environ: Mapping[str, str] = os.environ,
    master_addr: str | None = None,
    port: int | None = None,
) -> tuple[str, int]:
    """Host and port where rank 0 serves the store that the ranks meet at.

    A flag (``master_addr``, ``port``) wins over MASTER_ADDR and MASTER_PORT, except under
    torchrun: its agent already serves the store there and nothing would answer elsewhere.
    Without either, srun's ranks meet on the first node of the step; other launchers on
    127.0.0.1 when all ranks are on this machine. Raises ValueError when no host can be known.
    """
    env_addr, env_port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if world.launcher == "torchrun" and env_addr and env_port:
        return env_addr, int(env_port)
    addr = master_addr or env_addr
    if not addr and world.launcher == "slurm":
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        addr = first_host(nodelist) if nodelist else None
    if not addr and world.local_world_size == world.world_size:
        addr = "127.0.0.1"
    if not addr:
        raise ValueError(
            f"{world.launcher} started ranks on more than one machine and MASTER_ADDR is not set:"
            " pass --master-addr with the host name of rank 0's machine"
        )
    return addr, port or (int(env_port) if env_port else DEFAULT_PORT)


def choose_device(
    requested: str | None,
    backend: str | None,
    local_rank: int,
    gpus: int,
    ranks_here: int | None,
    same_gpus: bool = False,
) -> str:
    """The device one rank computes on: 'cpu' or 'cuda:N'.

    ``requested`` is --device (None: choose), ``backend`` --backend (None: choose), ``gpus`` the
    GPUs this process sees, ``ranks_here`` the ranks on this machine (None: unknown), ``same_gpus``
    whether every rank here sees the same GPUs (the course started them itself; srun may show each
    task a GPU of its own). Chosen: a GPU of its own for every rank when there are enough (rank r
    of a machine takes cuda:r), the CPU otherwise; with backend gloo the CPU. Ranks share a GPU only
    over gloo, asked with --device cuda: NCCL refuses two ranks on one GPU. Raises ValueError for a
    GPU that is not there.
    """
    if requested is None:
        enough = gpus > 0 and (ranks_here is None or ranks_here <= gpus)
        requested = "cuda" if backend == "nccl" or (backend is None and enough) else "cpu"
    if requested != "cuda":
        return requested
    if gpus == 0:
        raise ValueError(
            "no GPU is visible here (torch.cuda.device_count() is 0): leave out --device cuda and --backend nccl"
        )
    if local_rank < gpus:
        return f"cuda:{local_rank}"
    if gpus == 1 and not same_gpus:
        return "cuda:0"  # the launcher showed each rank only its own GPU (srun --gpus-per-task=1)
    if backend == "gloo" and same_gpus:
        return f"cuda:{local_rank % gpus}"
    raise ValueError(
        f"the rank with local rank {local_rank} has no GPU of its own: this machine shows {gpus} GPU(s), and"
        f" NCCL needs one per rank; start at most {gpus} rank(s) here (--world-size {gpus}), or pass"
        " --backend gloo (with --device cuda the ranks share the GPUs)"
    )


def choose_backend(requested: str | None, device: str) -> str:
    """nccl for GPU tensors, gloo for CPU ones, unless --backend says otherwise."""
    backend = requested or ("nccl" if device.startswith("cuda") else "gloo")
    if backend == "nccl" and not device.startswith("cuda"):
        raise ValueError(
            f"the nccl backend moves GPU tensors only, and this rank computes on {device}: use --backend gloo"
        )
    return backend


# How every check runs (the tests, the notebooks, autograding): one thread per worker, so
# workers fork fast and share the cores; collectives compared on every call; nothing waits long:
# a check's world takes under 5 s on 2 cores, so a world still running at 30 s of its own time
# (processes.OwnTime) will not end. Ranks that call different collectives, or wait where no peer can
# answer, are named when it happens (instrument.Agreement, the waits boards); the collective timeout
# is for the waits no board sees (DDP's all-reduces, in C++), and is a wall time that gloo keeps, so
# it is half the world's limit: at 4 s, a peer slowed by a loaded machine (its start, under a
# sandbox) failed a correct check. torch's own error lines about it (gloo's "failed to pass
# monitoredBarrier") say what the course's report says.
CHECK_SETTINGS = {
    "OMP_NUM_THREADS": "1",
    "COURSE_DEBUG": "1",
    "COURSE_TIMEOUT": "30",
    "COURSE_COLLECTIVE_TIMEOUT": "15",
    "TORCH_CPP_LOG_LEVEL": "FATAL",
}


# Once a world of an exercise has run out of time (an endless loop, most likely, that every check of
# the exercise would meet again), the exercise's later checks get worlds of this many seconds: a
# check's world takes under 5 s on a 2-core laptop.
HANG_WORLD_LIMIT = 10


def world_limit_after_a_hang(usual: str | None) -> str:
    """COURSE_TIMEOUT for an exercise's checks after one of its worlds ran out of time: the short
    limit, never longer than the usual one (``usual``, COURSE_TIMEOUT's value, where one is set)."""
    return f"{min(HANG_WORLD_LIMIT, float(usual or 'inf')):g}"


def check_settings(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The check settings that environ does not set already (a variable set by the user wins).

    Apply them before torch is imported: torch reads OMP_NUM_THREADS once.
    """
    return {k: v for k, v in CHECK_SETTINGS.items() if k not in environ}


def usable_cores() -> int:
    """Cores this process may run on (the affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_worker(world_size: int, cores: int, environ: Mapping[str, str] = os.environ) -> int:
    """Intra-op threads for one of ``world_size`` workers sharing ``cores``.

    Unpinned, every worker starts one thread per core and W workers fight over the same cores:
    two gloo workers on two cores ran a tiny MLP 20x slower. OMP_NUM_THREADS, when set, wins.
    """
    if environ.get("OMP_NUM_THREADS", "").strip().isdigit():
        return max(1, int(environ["OMP_NUM_THREADS"]))
    return max(1, cores // max(1, world_size))


# What a sandboxed worker keeps of its grader's environment (course/runtime/worker.py): the course's
# settings, Python's, torch's and its libraries', the locale and the search path. Nothing else: a
# grading job's secrets (a token, a cloud key) are not the submission's to read or print.
_FOR_WORKERS = ("COURSE_", "PYTHON", "TORCH", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "GLOO_", "NCCL_", "CUDA_")
_FOR_WORKERS_EXACTLY = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM", "USE_LIBUV", "PYTEST_XDIST_WORKER")


def for_workers(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of environ that a sandboxed world's workers get."""
    return {
        name: value
        for name, value in environ.items()
        if name.startswith(_FOR_WORKERS) or name.startswith("LC_") or name in _FOR_WORKERS_EXACTLY
    }


def loopback_settings(platform: str, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Environment variables a single-machine world needs on this platform.

    - gloo finds its network interface by resolving the host name. On macOS the host name often
      does not resolve; naming the loopback interface sidesteps that (and is right for one host).
    - TCPStore's libuv backend is missing from Windows wheels. Local worlds rendezvous through a
      FileStore and never start a TCPStore, but a user's own init_method may, so turn libuv off.
    A variable the user has set already is never overridden.
    """
    wanted = {}
    if platform == "darwin":
        wanted["GLOO_SOCKET_IFNAME"] = "lo0"
    elif platform.startswith("linux"):
        wanted["GLOO_SOCKET_IFNAME"] = "lo"
    elif platform == "win32":
        wanted["USE_LIBUV"] = "0"
    return {k: v for k, v in wanted.items() if k not in environ}


def libuv_available(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether TCPStore may use its libuv backend: not where USE_LIBUV=0 (Windows wheels lack it)."""
    return environ.get("USE_LIBUV", "1") != "0"


# What a worker imports before its first call (course/runtime/workers.py). A worker's first optimizer step
# imports torch._dynamo too: 1.4 s on 2 cores, paid by every rank at once. Under fork the parent
# imports it once a world's workers have needed it, so that later worlds start with it and a grading
# run whose worlds never step never pays it (exercises 2, 5). multiprocessing's forkserver starts
# once per process, so it imports all of them from the start.
WORKER_MODULES = ("torch", "torch.distributed", "numpy.random", "course.runtime.workers")
ON_DEMAND_MODULES = ("torch._dynamo",)
FORKSERVER_PRELOAD = [*WORKER_MODULES, *ON_DEMAND_MODULES]
# What calls import that a kept world's worker imports once a call of its world has needed it, so that
# its later calls, each in a child forked from it (course/runtime/worker.py), find it imported. Exercise
# 13's checkpoints import torch.distributed.checkpoint: 0.5 s a call otherwise.
CALL_MODULES = (*ON_DEMAND_MODULES, "torch.distributed.checkpoint")
# A file named by this variable takes what an autograding kernel's processes print at the descriptor
# level (course/instructors/kernels.py): the student's code in the workers, which inherit the kernel's
# descriptors, and gloo's and torch's own lines. It is the student's feedback, not the terminal's.
KERNEL_OUTPUT = "COURSE_KERNEL_OUTPUT"

# What a process that starts worlds imports later of its own accord (reading a result, a judge's
# first optimizer step, stopping a world): imported before its first world instead, so that nothing
# it runs is read from disk once submission code has run (tests/import_audit.py finds any other).
PARENT_MODULES = (
    "torch.utils.serialization",
    "torch.profiler._cupti_monitor",
    "multiprocessing.forkserver",
    "multiprocessing.resource_tracker",
)


def default_start_method(platform: str, threads: int, cuda_initialized: bool, device: str = "cpu") -> str:
    """The fastest safe way to start CPU workers here. COURSE_START_METHOD overrides.

    - fork (about 0.03 s a world) on Linux when each worker runs one thread. A forked child that
      starts an OpenMP parallel region after its parent used one hangs for ever (libgomp's thread
      pool does not survive fork; seen here with a 512x512 matmul), and CUDA cannot be used in a
      child forked after the parent touched it. With one thread no parallel region is entered.
    - forkserver on Linux otherwise: children are forked from a clean server process that never
      computed (about 1.7 s once per parent process for the server's torch import, then 0.03 s).
    - forkserver on macOS too (forking a process that has run Objective-C or threaded code is not
      safe there, but the server never computes): its one torch import replaces spawn's import
      per worker, which made a full grade about 10x slower.
    - spawn on Windows, which cannot fork: a fresh interpreter per worker.
    """
    override = os.environ.get("COURSE_START_METHOD")
    if override:
        return override
    if platform == "win32":
        return "spawn"
    if platform == "darwin":
        return "forkserver"
    if threads == 1 and device == "cpu" and not cuda_initialized:
        return "fork"
    return "forkserver"


def checks_start_method(platform: str, cores: int) -> str:
    """How the checks' worlds (2 to 4 ranks, checks/helpers.py) start their workers here."""
    return default_start_method(platform, threads_per_worker(2, cores), False)
