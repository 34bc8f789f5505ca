"""What the benchmarks share: timing across ranks, the record of a run, and pyplot for its figure.

Each benchmark runs as a script from bench/ (`python bench/zero.py`, say), which is why the
others import this module by its bare name.
"""

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


def slowest_rank(seconds):
    """The largest of the ranks' figures: a step is over when the last rank is done."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def interleaved(functions, rounds, per_round):
    """Seconds of each function, slowest rank: the fastest run, and the median run.

    Other programs on the machine only ever add time, so the fastest run is the best estimate of
    the cost itself; rounds take turns through the functions, so that a change in the machine's
    load falls on all of them alike. The first round warms up and is not counted.
    """
    times = {name: [] for name in functions}
    for r in range(rounds + 1):
        for name, fn in functions.items():
            dist.barrier()
            for _ in range(per_round):
                start = time.perf_counter()
                fn()
                if r:
                    times[name].append(time.perf_counter() - start)
    return {name: slowest_rank(min(t)) for name, t in times.items()}, {
        name: slowest_rank(statistics.median(t)) for name, t in times.items()
    }


class Record:
    """One run of benchmark NAME, from its start: how busy the machine was, and what it writes,
    bench/NAME.json with every figure and bench/NAME.png where matplotlib can draw it."""

    def __init__(self, name: str):
        self.name, self.start, self.load_before = name, time.perf_counter(), os.getloadavg()[0]

    def write(self, text: str, figures: dict, draw) -> None:
        """Print text and the machine's load; write figures with them; draw(path) the figure."""
        # Other programs on the machine slow some steps down: say how busy it was.
        load = (
            f"load average (1 min) {self.load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end,"
            f" on {os.cpu_count()} cores"
        )
        print(f"{text}\n{load}")
        with open(os.path.join(HERE, f"{self.name}.json"), "w") as f:
            json.dump(figures | {"machine_load": load, "seconds": time.perf_counter() - self.start}, f, indent=1)
        drawn = draw(os.path.join(HERE, f"{self.name}.png"))
        also = f" and bench/{self.name}.png" if drawn else " (no matplotlib: no plot)"
        print(f"wrote bench/{self.name}.json{also} in {time.perf_counter() - self.start:.0f} s")


def products_alone(weights, x, y):
    """A training step (SGD) of a chain of matrix products, tanh between them, on the rows x and labels y: what
    a rank of tensor parallelism computes with its blocks of the weights, without a collective."""
    optimizer = torch.optim.SGD(weights, lr=0.01)

    def step():
        optimizer.zero_grad(set_to_none=True)
        h = x
        for i, weight in enumerate(weights):
            h = torch.nn.functional.linear(h, weight)
            if i < len(weights) - 1:
                h = torch.tanh(h)
        torch.nn.functional.cross_entropy(h, y).backward()
        optimizer.step()

    return step


def pyplot():
    """matplotlib's pyplot drawing to files, or None where matplotlib is not installed: it comes
    with `python3 -m course setup --notebooks`, and a benchmark's figures are in its JSON anyway."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def side_by_side(results, path, draw) -> bool:
    """One panel per world size of results ({world size: figures}), draw(ax, world size, figures) filling each,
    written to path with the first panel's legend; False where there is no matplotlib (pyplot)."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (w, got) in zip(axes[0], results.items()):
        draw(ax, w, got)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True
