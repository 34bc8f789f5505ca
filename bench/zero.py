"""Optimizer-state memory per rank and step time of sharded Adam (ZeRO stage 1): `make bench-zero`.

    make bench-zero                          # the reference solutions
    COURSE_IMPL=student make bench-zero      # your own zero.py

For world sizes 1, 2 and 4 on CPU (gloo; the launcher gives each worker its share of the cores),
on the course's default MLP (one layer holds 65% of the weights) and on an even one (eight equal
layers), it measures one training step (zero_grad, forward, backward, Adam step) and the bytes of
Adam's state tensors on each rank, for three ways of training:
- unsharded: built-in DDP and plain Adam, every rank holds all the state;
- sharded: the bare model and exercise 11's ShardedOptimizer(Adam) (all-reduce, step the owned
  parameters, broadcast each from its owner);
- ZeroRedundancyOptimizer: built-in DDP and torch's ZeroRedundancyOptimizer(Adam).

Step times are the fastest of several steps, taken in turns (bench/overlap.py says why); the JSON
has the medians too. Writes bench/zero.json and bench/zero.png (with matplotlib), and prints the tables.
"""

import os
import sys
from dataclasses import asdict, replace
from functools import partial

import torch
import torch.distributed as dist
from common import Record, interleaved, pyplot
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from course import impl
from course.launch import bench, run

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD_SIZES = (1, 2, 4)
VARIANTS = ("unsharded", "sharded", "ZeroRedundancyOptimizer")


def models(mlp):
    default = mlp.ModelConfig()
    return {"default MLP": default, "even MLP": replace(default, d_in=256, n_layers=8, n_classes=256)}


def state_bytes(state):
    return sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if torch.is_tensor(t))


def training(ex, config, variant):
    """(one training step of a fresh model, a function giving this rank's optimizer-state bytes)."""
    torch.manual_seed(0)
    model = ex.mlp.MLP(config)
    if variant == "unsharded":
        forward, optimizer = DDP(model), torch.optim.Adam(model.parameters(), lr=1e-3)
        held = lambda: state_bytes(optimizer.state)  # noqa: E731
    elif variant == "sharded":
        forward, optimizer = model, ex.zero.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
        held = lambda: state_bytes(optimizer.state)  # noqa: E731
    else:
        forward = DDP(model)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
        held = lambda: state_bytes(optimizer.optim.state)  # noqa: E731
    x, y = torch.randn(config.batch_size, config.d_in), torch.randint(0, config.n_classes, (config.batch_size,))

    def step():
        optimizer.zero_grad(set_to_none=True)
        forward(x, y)[1].backward()
        optimizer.step()

    return step, held


def measure(folder, rounds, per_round):
    """On every rank of one world: each model and variant; state bytes by rank, step seconds."""
    ex = impl.load(folder)
    out = {}
    for name, config in models(ex.mlp).items():
        steps = {variant: training(ex, config, variant) for variant in VARIANTS}
        fastest, median = interleaved({variant: step for variant, (step, _) in steps.items()}, rounds, per_round)
        out[name] = {}
        for variant, (_, held) in steps.items():
            mine = torch.tensor([held()])
            everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, mine)
            out[name][variant] = {
                "state_bytes": [int(b) for b in everyone],
                "fastest_ms": fastest[variant] * 1000,
                "median_ms": median[variant] * 1000,
            }
    return out


def tables(results):
    lines = []
    for name in results[WORLD_SIZES[0]]:
        lines.append(f"{name}: optimizer state per rank in KiB (largest, smallest), fastest step in ms")
        lines.append(f"  {'variant':25}" + "".join(f"{f'W={w}':>24}" for w in WORLD_SIZES))
        for variant in VARIANTS:
            cells = []
            for w in WORLD_SIZES:
                got = results[w][name][variant]
                kib = [b / 1024 for b in got["state_bytes"]]
                cells.append(f"{max(kib):7.0f} {min(kib):6.0f} KiB {got['fastest_ms']:6.1f}")
            lines.append(f"  {variant:25}" + "".join(f"{c:>24}" for c in cells))
    return "\n".join(lines)


def plot(results, path) -> bool:
    """Per model: the largest rank's optimizer state, and the fastest step, against W, per variant."""
    plt = pyplot()
    if plt is None:
        return False
    names = list(results[WORLD_SIZES[0]])
    fig, axes = plt.subplots(2, len(names), figsize=(5 * len(names), 6), squeeze=False)
    for column, name in enumerate(names):
        for variant in VARIANTS:
            got = [results[w][name][variant] for w in WORLD_SIZES]
            axes[0][column].plot(WORLD_SIZES, [max(g["state_bytes"]) / 2**20 for g in got], "o-", label=variant)
            axes[1][column].plot(WORLD_SIZES, [g["fastest_ms"] for g in got], "o-", label=variant)
        axes[0][column].set_title(name)
        axes[0][column].set_ylabel("optimizer state, largest rank (MiB)")
        axes[1][column].set_ylabel("fastest step (ms)")
        axes[1][column].set_xlabel("ranks (W)")
        for ax in axes[:, column]:
            ax.set_xticks(WORLD_SIZES)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(rounds=3, per_round=4):
    folder = impl.selected()
    record = Record("zero")
    # No collective fingerprints: they add a check to every collective, and DDP cannot run with them.
    results = {w: run(measure, w, folder, rounds, per_round, debug=False)[0] for w in WORLD_SIZES}
    config = {name: asdict(c) for name, c in models(impl.load(folder).mlp).items()}
    figures = {"implementation": os.path.relpath(folder), "models": config, "results": results}
    record.write(tables(results), figures, partial(plot, results))


if __name__ == "__main__":
    sys.exit(bench(main, *map(int, sys.argv[1:])))
