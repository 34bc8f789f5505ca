"""A pipeline's bubble, measured against (p - 1) / (m + p - 1): `make bench-pp` (exercise 15).

    make bench-pp                          # the reference solutions
    COURSE_IMPL=student make bench-pp      # your own pp.py

For p = 2 and 4 stages and m = 1 to 16 micro-batches of ROWS rows each, it runs GPipe steps through
exercise 15's Pipeline, times every forward and backward of every stage (course/timeline.py's
Spans) and gives each stage's idle fraction: the share of the step, from the common start to the
last backward's end on any stage, in which the stage ran neither. Two kinds of stage:
- "fixed": every forward sleeps FORWARD seconds (10 ms) and every backward twice that, whatever
  the cores do, as if each stage had a device of its own (the formula's assumption); the messages
  are real, and so is the time a process takes to wake up when its message arrives;
- "compute": the layers of an MLP (8 layers of 1024, cut by stage_layers), real matrix products on
  this machine's cores, one thread per worker: what this machine does, where p = 4 stages share
  2 cores (and the cores are shared with other work).
It also times a whole step of GPipe and 1F1B, and of torch's ScheduleGPipe and Schedule1F1B on the
same compute stages (torch.distributed.pipelining), at m = 4, 8 and 16. Each figure comes from
the fastest of REPEATS recorded steps after a warm-up one, taken in turns with the other schedules
for the step times: other work on this shared machine only ever adds time (the JSON has the
medians of the step times too). Writes bench/pp.json and bench/pp.png (with matplotlib) and prints the
tables; about a minute and a half.
"""

import os
import statistics
import sys
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from common import Record, pyplot, slowest_rank

from course import impl, timeline
from course.launch import bench, run

HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = (2, 4)
MICRO_BATCHES = tuple(range(1, 17))
TIMED = (4, 8, 16)  # the m of the step-time table
ROWS = 32  # per micro-batch: a batch is m * ROWS rows, so a micro-batch costs the same at every m
WIDTH, LAYERS = 1024, 8
FORWARD = 0.01  # seconds, the "fixed" stages' forward; their backward takes twice as long
REPEATS = 3
TOLERANCE = 0.05  # the target: measured idle fraction within this of the formula


class Hold(torch.autograd.Function):
    """Passes its input through, taking `seconds` forward and twice that backward, on no core."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class FixedStage(nn.Module):
    """A stage whose time is Hold's: its own arithmetic (one scale per column) is next to nothing."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x):
        return Hold.apply(x * self.scale, FORWARD)


def stage_of(ex, kind):
    rank, p = dist.get_rank(), dist.get_world_size()
    if kind == "fixed":
        return FixedStage()
    config = ex.mlp.ModelConfig(n_layers=LAYERS, d_in=WIDTH, d_hidden=WIDTH, n_classes=WIDTH, seed=0)
    torch.manual_seed(0)
    return ex.pp.Stage(ex.mlp.MLP(config), ex.pp.stage_layers(LAYERS, p)[rank])


def ends(m):
    """This rank's share of a batch of m micro-batches: inputs on the first stage, targets on the last."""
    rank, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(m)
    x, y = torch.randn(m * ROWS, WIDTH, generator=g), torch.randint(0, WIDTH, (m * ROWS,), generator=g)
    return (x if rank == 0 else None), (y if rank == p - 1 else None)


def bubbles(folder, kind):
    """On every rank: for each m, REPEATS recorded GPipe steps; this rank's spans of each."""
    ex = impl.load(folder)
    stage, rank, p = stage_of(ex, kind), dist.get_rank(), dist.get_world_size()
    out = {}
    for m in MICRO_BATCHES:
        events = ex.pp.gpipe(m, p, rank)
        ex.pp.Pipeline(stage, m, (ROWS, WIDTH)).run(events, *ends(m))  # warm-up
        out[m] = []
        for _ in range(REPEATS):
            pipeline = ex.pp.Pipeline(stage, m, (ROWS, WIDTH))
            spans = timeline.Spans()
            pipeline.forward = spans.timed(pipeline.forward, "forward", "F")
            pipeline.backward = spans.timed(pipeline.backward, "backward", "B")
            dist.barrier()
            spans.restart()
            pipeline.run(events, *ends(m))
            out[m].append(spans.events)
    return out


def our_step(pp, stage, m, events, x, y):
    return pp.Pipeline(stage, m, (ROWS, WIDTH)).run(events, x, y)


def torch_step(schedule, x, y):
    """One step of torch's schedule: the inputs on the first stage, the targets on the last."""
    return schedule.step(*([] if x is None else [x]), **({} if y is None else {"target": y}))


def step_times(folder):
    """On every rank: the median step time (slowest rank) of each schedule, ours and torch's, at each m of TIMED."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    ex = impl.load(folder)
    stage, rank, p = stage_of(ex, "compute"), dist.get_rank(), dist.get_world_size()
    out = {}
    for m in TIMED:
        x, y = ends(m)
        steps = {
            name: partial(our_step, ex.pp, stage, m, ex.pp.SCHEDULES[name](m, p, rank), x, y)
            for name in ("gpipe", "1f1b")
        }
        for name, kind in (("torch GPipe", ScheduleGPipe), ("torch 1F1B", Schedule1F1B)):
            schedule = kind(
                PipelineStage(stage, rank, p, torch.device("cpu")), n_microbatches=m, loss_fn=F.cross_entropy
            )
            steps[name] = partial(torch_step, schedule, x, y)
        times = {name: [] for name in steps}
        for r in range(REPEATS + 1):  # in turns; the first round warms up
            for name, step in steps.items():
                stage.zero_grad()
                dist.barrier()
                start = time.perf_counter()
                step()
                took = slowest_rank(time.perf_counter() - start)
                if r:
                    times[name].append(took)
        out[m] = {
            name: {"fastest_ms": min(t) * 1000, "median_ms": statistics.median(t) * 1000} for name, t in times.items()
        }
    return out


def bubble(p, m):
    return (p - 1) / (m + p - 1)


def idle_by_stage(per_rank, m):
    """Each stage's idle fraction in the shortest of the recorded steps: other work on the machine
    only ever delays a stage, so the shortest step is the least disturbed one."""
    steps = [[events[m][k] for events in per_rank] for k in range(REPEATS)]
    return timeline.idle_fractions(min(steps, key=lambda runs: max(e["end"] for events in runs for e in events)))


def tables(results):
    lines = []
    for kind, per_p in results["idle"].items():
        lines.append(f"{kind} stages: GPipe's idle fraction by stage, measured, against (p - 1)/(m + p - 1)")
        lines.append("     m" + "".join(f"   p={p}: {'stages':>{6 * p - 1}} formula" for p in STAGES))
        for m in MICRO_BATCHES:
            cells = "".join(
                f"   {' '.join(f'{v:.2f}' for v in per_p[p][m]):>{5 * p + p - 1 + 6}} {bubble(p, m):6.2f}"
                for p in STAGES
            )
            lines.append(f"  {m:4d}{cells}")
        for p in STAGES:
            worst = max(abs(v - bubble(p, m)) for m in MICRO_BATCHES for v in per_p[p][m])
            lines.append(f"  p={p}: largest difference from the formula {worst:.3f} (target {TOLERANCE})")
    lines.append("step time in ms (compute stages; fastest, slowest rank)")
    names = list(results["steps"][STAGES[0]][TIMED[0]])
    lines.append("  p   m" + "".join(f"{n:>13}" for n in names))
    for p in STAGES:
        for m in TIMED:
            lines.append(f"  {p}  {m:2d}" + "".join(f"{results['steps'][p][m][n]['fastest_ms']:13.1f}" for n in names))
    return "\n".join(lines)


def plot(results, path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(STAGES), figsize=(6 * len(STAGES), 4), squeeze=False)
    for ax, p in zip(axes[0], STAGES):
        ax.plot(MICRO_BATCHES, [bubble(p, m) for m in MICRO_BATCHES], "k-", label="(p - 1)/(m + p - 1)")
        for kind, marker in (("fixed", "o"), ("compute", "x")):
            per_m = results["idle"][kind][p]
            for s in range(p):
                ax.plot(
                    MICRO_BATCHES,
                    [per_m[m][s] for m in MICRO_BATCHES],
                    marker,
                    ms=4,
                    alpha=0.7,
                    label=f"{kind} stages" if s == 0 else None,
                    color=f"C{0 if kind == 'fixed' else 1}",
                )
        ax.set_title(f"GPipe, p = {p} stages")
        ax.set_xlabel("micro-batches m")
        ax.set_ylabel("idle fraction of each stage")
        ax.set_ylim(0, 1)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    folder = impl.selected()
    record = Record("pp")
    # No collective checks: timing, not grading.
    idle = {kind: {} for kind in ("fixed", "compute")}
    for kind, per_p in idle.items():
        for p in STAGES:
            per_rank = run(bubbles, p, folder, kind, debug=False)
            per_p[p] = {m: idle_by_stage(per_rank, m) for m in MICRO_BATCHES}
    steps = {p: run(step_times, p, folder, debug=False)[0] for p in STAGES}
    results = {"idle": idle, "steps": steps}
    settings = dict(rows=ROWS, width=WIDTH, layers=LAYERS, fixed_forward_s=FORWARD, repeats=REPEATS)
    figures = {"implementation": os.path.relpath(folder), "settings": settings, "results": results}
    record.write(tables(results), figures, partial(plot, results))


if __name__ == "__main__":
    sys.exit(bench(main))
