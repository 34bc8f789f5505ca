"""What one world costs to start and finish, per start method: `make bench-launch`.

Times course.launch.run for a world whose ranks each do one all_reduce, so the figure is the
launcher's own cost: start the processes, rendezvous, init gloo, collect, stop.
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist

from course.launch import run


def one_all_reduce():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


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
        rows.append((world_size, "fork", "DETAIL", statistics.median(times), None))
    print(f"{'world':>5}  {'start':<10}  {'fingerprints':<12}  {'s per world':>11}  {'first world':>11}")
    for world_size, method, debug, steady, first in rows:
        first_text = f"{first:.2f}" if first is not None else ""
        print(f"{world_size:>5}  {method:<10}  {debug:<12}  {steady:>11.3f}  {first_text:>11}")
    fork2 = next(r[3] for r in rows if r[:3] == (2, "fork", "off"))
    spawn2 = next(r[3] for r in rows if r[:3] == (2, "spawn", "off"))
    print(f"spawn / fork at world size 2: {spawn2 / fork2:.0f}x")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
