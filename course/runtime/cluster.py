"""Join the world of a cluster launcher (torchrun, srun, mpiexec) as one of its ranks."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from course.device import bound_device
from course.device import select as select_device
from course.runtime import env


@contextmanager
def settings_or_exit():
    """A setting that cannot work (course.runtime.env raises ValueError) stops the script with its reason."""
    try:
        yield
    except ValueError as reason:
        print(f"Cannot start: {reason}.", file=sys.stderr)
        raise SystemExit(2) from None


def choose(
    device: str | None, backend: str | None, local_rank: int, ranks_here: int | None, speak: bool, same_gpus: bool
) -> tuple:
    """This rank's device and the world's backend; ``speak``: say why visible GPUs go unused;
    ``same_gpus``: every rank here sees the same GPUs (env.choose_device)."""
    gpus = torch.cuda.device_count()
    with settings_or_exit():
        where = env.choose_device(device, backend, local_rank, gpus, ranks_here, same_gpus)
        chosen = env.choose_backend(backend, where)
    if speak and gpus and where == "cpu" and device is None and backend is None:
        print(
            f"note: {ranks_here} ranks on this machine and {gpus} GPU(s): every rank computes on the CPU"
            " (each needs a GPU of its own; --device cuda insists)",
            file=sys.stderr,
        )
    return where, chosen


def run_in_external_world(
    fn: Callable,
    args: tuple,
    world: env.ExternalWorld,
    world_size: int,
    master_addr: str | None,
    port: int | None,
    backend: str | None,
    device: str | None,
) -> list:
    with settings_or_exit():
        addr, port = env.rendezvous(world, os.environ, master_addr, port)
    speak = world.rank == 0
    where, backend = choose(device, backend, world.local_rank, world.local_world_size, speak, same_gpus=False)
    if speak and world_size != world.world_size:
        print(
            f"note: {world.launcher} started {world.world_size} ranks; --world-size {world_size} does not apply",
            file=sys.stderr,
        )
    # The names torchrun sets, for env:// below and for code that reads os.environ["RANK"].
    os.environ.update(
        RANK=str(world.rank),
        WORLD_SIZE=str(world.world_size),
        LOCAL_RANK=str(world.local_rank),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )
    if addr in ("127.0.0.1", "localhost"):
        os.environ.update(env.loopback_settings(sys.platform))  # all ranks are here: loopback works everywhere
    select_device(where)
    limit = os.environ.get("COURSE_COLLECTIVE_TIMEOUT")
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=world.rank,
        world_size=world.world_size,
        timeout=timedelta(seconds=float(limit)) if limit else None,
        device_id=bound_device(backend),
    )
    result = fn(*args)
    dist.barrier()  # as in a local world: a skipped collective shows up here, not as a hang
    dist.destroy_process_group()
    if world.rank != 0:
        raise SystemExit(0)
    return [result]
