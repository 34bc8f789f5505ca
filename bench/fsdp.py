"""Memory per rank and step time of DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (exercise 13): `make bench-fsdp`.

    make bench-fsdp                          # the reference solutions
    COURSE_IMPL=student make bench-fsdp      # your own fsdp.py (and zero.py for ZeRO-1)

For world sizes 1 to 4 on CPU (gloo; the launcher gives each worker its share of the cores), on
the course's default MLP (one layer holds 65% of the weights) and on an even one (eight equal
layers), it trains with Adam under each strategy of fsdp.py's setup(): built-in DDP, exercise 11's
ShardedOptimizer (ZeRO-1), and the units of exercise 13 (ZeRO-2, ZeRO-3); and, for the step time,
torch's fully_shard (FSDP2, each layer a unit, then the whole model) on the same model. Per rank it
measures the bytes under the parameters, the gradients after the backward and Adam's state, and
the peak of the gathered full parameters (course/memory.py), and puts beside them what the
handout's formula says. Step times are the fastest of several steps, the strategies taken in turns
(bench/overlap.py says why); the JSON has the medians too.

Writes bench/fsdp.json and bench/fsdp.png (with matplotlib), and prints the tables.
"""

import json
import os
import sys
from dataclasses import asdict, replace
from functools import partial

import torch
import torch.distributed as dist
from common import Record, interleaved, pyplot

from course import impl
from course.launch import bench, run
from course.memory import Gathered

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD_SIZES = (1, 2, 3, 4)
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
TIMED = (*STRATEGIES, "fully_shard")
PARTS = ("parameters", "gathered", "gradients", "optimizer")
TARGETS = {"zero3 memory within": 0.10, "zero3 step time over fully_shard at most": 1.2}


def models(mlp):
    default = mlp.ModelConfig()
    return {"default MLP": default, "even MLP": replace(default, d_in=256, n_layers=8, n_classes=256)}


def formula(config, strategy, world_size):
    """The handout's bytes per rank (float32, Adam), from the layers' sizes: padding and Adam's step counts left out."""
    sizes = [config.d_in * config.d_hidden] + [config.d_hidden**2] * (config.n_layers - 2)
    sizes.append(config.d_hidden * config.n_classes)
    psi, largest = sum(sizes), max(sizes)
    return {
        "ddp": 4 * psi + 4 * psi + 8 * psi,
        "zero1": 4 * psi + 4 * psi + 8 * psi / world_size,
        "zero2": 4 * psi / world_size + 4 * psi + 4 * psi / world_size + 8 * psi / world_size,
        "zero3": 4 * psi / world_size + 4 * largest + 4 * psi / world_size + 8 * psi / world_size,
    }[strategy]


def fully_sharded(model, lr):
    """torch's FSDP2 on the MLP: each layer, then the whole model, on a CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    return model, optimizer


def training(ex, config, strategy):
    """(one training step, a function of this rank's bytes) for a fresh model under one strategy."""
    torch.manual_seed(0)
    model = ex.mlp.MLP(config)
    if strategy == "fully_shard":
        forward, optimizer = fully_sharded(model, 1e-3)
    else:
        forward, optimizer = ex.fsdp.setup(model, strategy, 1e-3)
    x, y = torch.randn(config.batch_size, config.d_in), torch.randint(0, config.n_classes, (config.batch_size,))
    held = {}

    def step():
        optimizer.zero_grad(set_to_none=True)
        forward(x, y)[1].backward()
        if strategy != "fully_shard":  # its gradients are DTensors; its memory is not measured here
            held["gradients"] = ex.fsdp.storage_bytes(p.grad for p in model.parameters() if p.grad is not None)
        optimizer.step()

    def bytes_held():
        with Gathered() as gathered:
            step()
        return [
            ex.fsdp.storage_bytes(model.parameters()),
            gathered.peak_bytes(),
            held["gradients"],
            ex.fsdp.state_bytes(optimizer),
        ]

    return step, bytes_held


def measure(folder, rounds, per_round):
    """On every rank of one world: each model and strategy; bytes by rank and part, step seconds."""
    torch.set_num_threads(1)
    ex = impl.load(folder)
    out = {}
    for name, config in models(ex.mlp).items():
        trained = {strategy: training(ex, config, strategy) for strategy in TIMED}
        fastest, median = interleaved({strategy: step for strategy, (step, _) in trained.items()}, rounds, per_round)
        out[name] = {s: {"fastest_ms": fastest[s] * 1000, "median_ms": median[s] * 1000} for s in TIMED}
        for strategy in STRATEGIES:
            mine = torch.tensor(trained[strategy][1]())
            everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, mine)
            out[name][strategy]["bytes"] = [dict(zip(PARTS, map(int, b))) for b in everyone]
            out[name][strategy]["formula"] = formula(config, strategy, dist.get_world_size())
    return out


def largest_rank(got):
    return max(sum(b.values()) for b in got["bytes"])


def tables(results):
    lines = []
    for name in results[WORLD_SIZES[0]]:
        lines.append(f"{name}: bytes per rank in KiB, measured (largest rank) / formula; fastest step in ms")
        lines.append(f"  {'strategy':12}" + "".join(f"{f'W={w}':>26}" for w in WORLD_SIZES))
        for strategy in TIMED:
            cells = []
            for w in WORLD_SIZES:
                got = results[w][name][strategy]
                memory = f"{largest_rank(got) / 1024:6.0f} /{got['formula'] / 1024:6.0f}" if "bytes" in got else ""
                cells.append(f"{memory} {got['fastest_ms']:7.1f}")
            lines.append(f"  {strategy:12}" + "".join(f"{c:>26}" for c in cells))
    return "\n".join(lines)


def verdicts(results):
    """The issue's targets, per model and world size: ZeRO-3's memory against the formula, its step against fully_shard."""
    out = {}
    for name in results[WORLD_SIZES[0]]:
        for w in WORLD_SIZES:
            zero3, theirs = results[w][name]["zero3"], results[w][name]["fully_shard"]
            off = largest_rank(zero3) / zero3["formula"] - 1
            ratio = zero3["fastest_ms"] / theirs["fastest_ms"]
            out[f"{name}, W={w}"] = {
                "zero3 memory off the formula": round(off, 4),
                "zero3 step / fully_shard step": round(ratio, 3),
                "met": abs(off) <= TARGETS["zero3 memory within"]
                and ratio <= TARGETS["zero3 step time over fully_shard at most"],
            }
    return out


def plot(results, path) -> bool:
    """Per model: the largest rank's bytes (measured, and the formula dashed) and the fastest step, against W."""
    plt = pyplot()
    if plt is None:
        return False
    names = list(results[WORLD_SIZES[0]])
    fig, axes = plt.subplots(2, len(names), figsize=(5.5 * len(names), 7), squeeze=False)
    for column, name in enumerate(names):
        for i, strategy in enumerate(TIMED):
            got = [results[w][name][strategy] for w in WORLD_SIZES]
            colour = f"C{i}"
            if strategy in STRATEGIES:
                axes[0][column].plot(
                    WORLD_SIZES, [largest_rank(g) / 2**20 for g in got], "o-", color=colour, label=strategy
                )
                axes[0][column].plot(WORLD_SIZES, [g["formula"] / 2**20 for g in got], "--", color=colour, alpha=0.6)
            axes[1][column].plot(WORLD_SIZES, [g["fastest_ms"] for g in got], "o-", color=colour, label=strategy)
        axes[0][column].set_title(f"{name} (dashed: the handout's formula)")
        axes[0][column].set_ylabel("bytes per rank, largest rank (MiB)")
        axes[1][column].set_ylabel("fastest step (ms)")
        axes[1][column].set_xlabel("ranks (W)")
        for ax in axes[:, column]:
            ax.set_xticks(WORLD_SIZES)
    axes[0][0].legend()
    axes[1][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(rounds=3, per_round=4):
    folder = impl.selected()
    record = Record("fsdp")
    # No collective fingerprints: they add a check to every collective, and DDP cannot run with them.
    results = {w: run(measure, w, folder, rounds, per_round, debug=False)[0] for w in WORLD_SIZES}
    met = verdicts(results)
    config = {name: asdict(c) for name, c in models(impl.load(folder).mlp).items()}
    figures = {"implementation": os.path.relpath(folder), "models": config, "results": results}
    figures |= {"targets": TARGETS, "verdicts": met}
    record.write(f"{tables(results)}\n{json.dumps(met, indent=1)}", figures, partial(plot, results))


if __name__ == "__main__":
    sys.exit(bench(main, *map(int, sys.argv[1:])))
