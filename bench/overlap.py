"""Step time of data parallel training, by hand and built in, and ring all-reduce against gloo's.

    make bench                          # the reference solutions
    COURSE_IMPL=student make bench      # your own mlp.py, dist.py and mydp.py

For world sizes 1, 2 and 4 on CPU (gloo; the launcher gives each worker its share of the cores),
and for the course's default MLP and a larger one that communicates more, it times one training
step (zero_grad, forward, backward, SGD step) of: the bare model (each rank alone: the computation
without communication), built-in DDP, MyDP (exercise 4), OverlappedDP with one all-reduce per
parameter, and OverlappedDP with buckets of a few sizes. The exposed communication of a variant is
its step time less the bare model's, as a share of its step time. Then it times ring_all_reduce
(exercise 5) against dist.all_reduce at several sizes.

Tables and ratios use the fastest of several steps (see interleaved); the JSON has the medians too.
Writes bench/overlap.json (every figure) and bench/overlap.png, and prints the tables.
"""

import os
import sys
from dataclasses import asdict, replace
from functools import partial

import torch
import torch.distributed as dist
from common import Record, interleaved, pyplot
from torch.nn.parallel import DistributedDataParallel as DDP

from course import impl
from course.launch import bench, run

WORLD_SIZES = (1, 2, 4)
BUCKET_MB = (1, 4, 25)  # 25 MiB is DDP's default
RING_MB = (1, 4, 16, 64)
TARGET_RING_MB = 16


def models(mlp):
    """name -> (config, steps per round). The larger MLP has 13x the parameters for 5x the work."""
    default = mlp.ModelConfig()
    return {
        "default MLP": (default, 5),
        "large MLP": (replace(default, n_layers=6, d_hidden=1024), 2),
    }


def variants(mydp):
    """name -> function that wraps a fresh model (None: the bare model)."""
    out = {
        "bare model": None,
        "DDP": DDP,
        "MyDP (hooks)": mydp.MyDP,
        "overlapped": partial(mydp.OverlappedDP, bucket_cap_mb=0),
    }
    for mb in BUCKET_MB:
        out[f"bucketed {mb} MiB"] = partial(mydp.OverlappedDP, bucket_cap_mb=mb)
    return out


def training_step(mlp, config, wrap):
    """A function that runs one training step of a fresh, wrapped model on a fixed batch."""
    torch.manual_seed(0)
    model = mlp.MLP(config)
    if wrap is not None:
        model = wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(config.batch_size, config.d_in), torch.randint(0, config.n_classes, (config.batch_size,))

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        optimizer.step()

    return step


def measure(folder, rounds):
    """On every rank of one world: every model and variant, then the all-reduces."""
    ex = impl.load(folder)
    steps, step_medians = {}, {}
    for model_name, (config, per_round) in models(ex.mlp).items():
        functions = {name: training_step(ex.mlp, config, wrap) for name, wrap in variants(ex.mydp).items()}
        steps[model_name], step_medians[model_name] = interleaved(functions, rounds, per_round)
    reduces, reduce_medians = {}, {}
    if dist.get_world_size() > 1:
        for mb in RING_MB:
            tensor = torch.ones((mb << 20) // 4)
            functions = {"gloo": partial(dist.all_reduce, tensor), "ring": partial(ex.dist.ring_all_reduce, tensor)}
            reduces[mb], reduce_medians[mb] = interleaved(functions, rounds, 1)
    return {
        "steps": steps,
        "all_reduce": reduces,
        "median_steps": step_medians,
        "median_all_reduce": reduce_medians,
        "threads": torch.get_num_threads(),
    }


def derived(results):
    """Communication shares and the target ratios, from the measured times."""
    ratios = {}
    for w, res in results.items():
        for model_name, times in res["steps"].items():
            bare = times["bare model"]
            res.setdefault("exposed_communication_share", {})[model_name] = {
                name: max(0.0, (t - bare) / t) for name, t in times.items() if name != "bare model"
            }
            if w == 2:
                ratios[f"{model_name}: bucketed 25 MiB / DDP at W=2"] = times["bucketed 25 MiB"] / times["DDP"]
                best = min((t, name) for name, t in times.items() if name.startswith("bucketed"))
                ratios[f"{model_name}: best bucketed ({best[1]}) / DDP at W=2"] = best[0] / times["DDP"]
        for mb, t in res["all_reduce"].items():
            res.setdefault("bus_bandwidth_GBps", {})[mb] = {
                name: 2 * (w - 1) / w * (mb << 20) / s / 1e9 for name, s in t.items()
            }
            if mb == TARGET_RING_MB:
                ratios[f"ring / gloo at {mb} MiB, W={w}"] = t["ring"] / t["gloo"]
    return ratios


def tables(results, ratios):
    lines = []
    for model_name in results[WORLD_SIZES[0]]["steps"]:
        names = list(results[WORLD_SIZES[0]]["steps"][model_name])
        lines.append(f"{model_name}: fastest step in ms (exposed communication share)")
        lines.append(f"  {'variant':<18}" + "".join(f"{'W=' + str(w):>16}" for w in WORLD_SIZES))
        for name in names:
            cells = []
            for w in WORLD_SIZES:
                ms = results[w]["steps"][model_name][name] * 1000
                share = results[w]["exposed_communication_share"][model_name].get(name)
                cells.append(f"{ms:9.1f}" + (f" ({share:3.0%})" if share is not None else "      "))
            lines.append((f"  {name:<18}" + "".join(f"{c:>16}" for c in cells)).rstrip())
        lines.append("")
    lines.append("all-reduce of float32: fastest, ms (bus bandwidth GB/s)")
    multi = [w for w in WORLD_SIZES if w > 1]
    lines.append(f"  {'MiB':>5}" + "".join(f"{f'gloo W={w}':>18}{f'ring W={w}':>18}" for w in multi))
    for mb in RING_MB:
        cells = []
        for w in multi:
            for name in ("gloo", "ring"):
                ms = results[w]["all_reduce"][mb][name] * 1000
                cells.append(f"{ms:9.1f} ({results[w]['bus_bandwidth_GBps'][mb][name]:4.2f})")
        lines.append(f"  {mb:>5}" + "".join(f"{c:>18}" for c in cells))
    lines.append("")
    lines += [f"{name}: {value:.2f}x" for name, value in ratios.items()]
    return "\n".join(lines)


def plot(results, path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    model_names = list(results[WORLD_SIZES[0]]["steps"])
    fig, axes = plt.subplots(1, len(model_names) + 1, figsize=(6 * (len(model_names) + 1), 4.5))
    for ax, model_name in zip(axes, model_names):
        names = list(results[WORLD_SIZES[0]]["steps"][model_name])
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ms = [results[w]["steps"][model_name][name] * 1000 for w in WORLD_SIZES]
            ax.bar([j + i * width for j in range(len(WORLD_SIZES))], ms, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(WORLD_SIZES))], [f"W={w}" for w in WORLD_SIZES])
        ax.set_ylabel("ms per step")
        ax.set_title(model_name)
    axes[0].legend(fontsize=8)
    ax = axes[-1]
    for w in WORLD_SIZES[1:]:
        for name, style in (("gloo", "-o"), ("ring", "--s")):
            ax.plot(
                RING_MB, [results[w]["all_reduce"][mb][name] * 1000 for mb in RING_MB], style, label=f"{name} W={w}"
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("MiB of float32")
    ax.set_ylabel("ms per all-reduce")
    ax.set_title("ring_all_reduce vs gloo")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main(rounds=4):
    folder = impl.selected()
    record = Record("overlap")
    # No collective fingerprints: they add a check to every collective, and DDP cannot run with them.
    results = {w: run(measure, w, folder, rounds, debug=False)[0] for w in WORLD_SIZES}
    ratios = derived(results)
    config = {name: asdict(c) for name, (c, _) in models(impl.load(folder).mlp).items()}
    figures = {"implementation": os.path.relpath(folder), "models": config, "ratios": ratios, "results": results}
    record.write(tables(results, ratios), figures, partial(plot, results))


if __name__ == "__main__":
    sys.exit(bench(main, *map(int, sys.argv[1:])))
