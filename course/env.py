"""Decisions taken from the environment, kept free of side effects so they can be unit-tested.

Every function here reads a mapping (normally ``os.environ``) and facts about the platform that
the caller passes in, and returns a plain value. ``course.launch`` applies them.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class ExternalWorld:
    """A world started by a cluster launcher: this process is one of its ranks."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: Optional[str]
    master_port: Optional[int]


# (launcher, rank, world size, local rank) variable names, in the order they are tried.
# torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; srun sets SLURM_*; OpenMPI's mpiexec sets
# OMPI_COMM_WORLD_*; MPICH and Intel MPI (Hydra) set PMI_* and MPI_LOCALRANKID.
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


def external_world(environ: Mapping[str, str] = os.environ) -> Optional[ExternalWorld]:
    """The world a cluster launcher put this process in, or None when we must start our own."""
    for launcher, rank_var, size_var, local_var in _LAUNCHERS:
        if rank_var in environ and size_var in environ:
            port = environ.get("MASTER_PORT")
            return ExternalWorld(
                launcher=launcher,
                rank=int(environ[rank_var]),
                world_size=int(environ[size_var]),
                local_rank=int(environ.get(local_var, 0)),
                master_addr=environ.get("MASTER_ADDR"),
                master_port=int(port) if port else None,
            )
    return None


# How every check runs (the tests, the notebooks, autograding): one thread per worker, so
# workers fork fast and share the cores; collectives compared on every call; nothing waits long.
CHECK_SETTINGS = {"OMP_NUM_THREADS": "1", "COURSE_DEBUG": "1", "COURSE_TIMEOUT": "60", "COURSE_COLLECTIVE_TIMEOUT": "10"}


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


def default_start_method(platform: str, threads: int, cuda_initialized: bool, device: str = "cpu") -> str:
    """The fastest safe way to start CPU workers here. COURSE_START_METHOD overrides.

    - fork (about 0.03 s a world) on Linux when each worker runs one thread. A forked child that
      starts an OpenMP parallel region after its parent used one hangs for ever (libgomp's thread
      pool does not survive fork; seen here with a 512x512 matmul), and CUDA cannot be used in a
      child forked after the parent touched it. With one thread no parallel region is entered.
    - forkserver on Linux otherwise: children are forked from a clean server process that never
      computed (about 1.7 s once per parent process for the server's torch import, then 0.03 s).
    - spawn elsewhere (macOS and Windows cannot fork safely): a fresh interpreter per worker.
    """
    override = os.environ.get("COURSE_START_METHOD")
    if override:
        return override
    if not platform.startswith("linux"):
        return "spawn"
    if threads == 1 and device == "cpu" and not cuda_initialized:
        return "fork"
    return "forkserver"
