"""What one world costs to start and finish, per start method: `make bench-launch`.

Times course.launch.run for a world whose ranks each do one all_reduce, so the figure is the
launcher's own cost: start the processes, rendezvous, init gloo, collect, stop; with the ranks' comparison
of collectives (course/runtime/instrument.py's Agreement) off and on. For comparison,
the same world started by torch's own torch.distributed.elastic.multiprocessing.start_processes.
"""

import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from course.launch import run


def one_all_reduce():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def elastic_entry(store_path, world_size):
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world_size),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    result = one_all_reduce()
    dist.destroy_process_group()
    return result


def elastic_seconds_per_world(world_size, repeats, method):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    times = []
    for _ in range(repeats):
        folder = tempfile.mkdtemp()
        start = time.perf_counter()
        context = start_processes(
            name="bench",
            entrypoint=elastic_entry,
            start_method=method,
            args={r: (os.path.join(folder, "store"), world_size) for r in range(world_size)},
            envs={r: {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world_size)} for r in range(world_size)},
            logs_specs=DefaultLogsSpecs(log_dir=folder),
        )
        while (result := context.wait(timeout=60, period=0.01)) is None:
            pass
        assert not result.is_failed(), result.failures
        times.append(time.perf_counter() - start)
    return times


def seconds_per_world(world_size, repeats, **options):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(one_all_reduce, world_size, **options)
        times.append(time.perf_counter() - start)
    return times


def main(repeats=5):
    rows = []
    for world_size in (2, 4):
        for method in ("fork", "forkserver", "spawn"):
            times = seconds_per_world(world_size, repeats if method != "spawn" else 2, start_method=method)
            first = times[0] if method == "forkserver" else None
            steady = statistics.median(times[1:] if method == "forkserver" else times)
            rows.append((world_size, method, "off", steady, first))
        times = seconds_per_world(world_size, repeats, start_method="fork", debug=True)
        rows.append((world_size, "fork", "on", statistics.median(times), None))
        times = elastic_seconds_per_world(world_size, repeats, "fork")
        rows.append((world_size, "elastic fork", "off", statistics.median(times), None))
    print(f"{'world':>5}  {'start':<12}  {'compared':<12}  {'s per world':>11}  {'first world':>11}")
    for world_size, method, debug, steady, first in rows:
        first_text = f"{first:.2f}" if first is not None else ""
        print(f"{world_size:>5}  {method:<12}  {debug:<12}  {steady:>11.3f}  {first_text:>11}")
    fork2 = next(r[3] for r in rows if r[:3] == (2, "fork", "off"))
    spawn2 = next(r[3] for r in rows if r[:3] == (2, "spawn", "off"))
    elastic2 = next(r[3] for r in rows if r[:2] == (2, "elastic fork"))
    print(f"spawn / fork at world size 2: {spawn2 / fork2:.0f}x; torch elastic / ours (fork): {elastic2 / fork2:.2f}x")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
