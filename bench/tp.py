"""Tensor parallelism against data parallelism, measured and predicted by exercise 12's model: `make bench-tp`.

    make bench-tp                        # the reference solutions
    COURSE_IMPL=student make bench-tp    # your own tp.py and cost.py

On 2 and 4 ranks (gloo, the default MLP: 1024 -> 256 -> 256 -> 256 -> 32, no collective
checking), for batches of 16 to 4096 rows in all, it times one training step (zero_grad,
forward, backward, SGD step) of:
- tensor parallel: exercise 14's ParallelMLP, every rank runs every row (train_step);
- data parallel: the whole MLP, every rank runs 1/W of the rows, then one all-reduce per gradient,
  one after the other, and the average (exercise 4's MyDP, what exercise 12 modelled).
Each figure is the fastest of several steps, taken in turns with the others (bench/overlap.py
says why); the JSON has the medians too. Then exercise 12's model predicts both, from figures
taken in the same world:
- T_comp of each variant without its communication, every rank at once (they share the cores):
  data parallel, the whole MLP alone on B / W rows; tensor parallel, this rank's blocks of the
  weights alone on all B rows. The products are the same work cut two ways, but tensor
  parallelism runs what lies between them (tanh, the loss) on every row on every rank;
- alpha and beta: fit_alpha_beta on the fastest ping-pongs between ranks 0 and 1, 1 KiB to 1 MiB;
- tensor parallel: its T_comp, plus a ring all-reduce of each block's output (B x 256 and B x 32
  floats) and of the second block's input gradient (B x 256; the first block's input, the data,
  needs none);
- data parallel: its T_comp, plus a ring all-reduce of each gradient (the parameters, once).
Tensor parallelism's bytes grow with the rows, data parallelism's do not. The crossover is the
batch from which data parallelism stays the faster, measured and predicted: the last change from
tensor to data parallelism, interpolated on log scales (a busy machine can swap two close figures
before it). Also printed: where the bytes alone are equal. Writes bench/tp.json and, with
matplotlib, bench/tp.png.
"""

import math
import os
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from common import Record, interleaved, products_alone, side_by_side

from course import impl
from course.launch import bench, run

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD_SIZES = (2, 4)
BATCHES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SIZES = [2**k for k in range(10, 21, 2)]  # ping-pongs, 1 KiB to 1 MiB, as exercise 12
VARIANTS = ("tensor parallel", "data parallel")


def steps(ex, config, rows):
    """One step of each variant, and of each one's computation alone."""
    world_size = dist.get_world_size()
    torch.manual_seed(0)
    x, y = torch.randn(rows, config.d_in), torch.randint(0, config.n_classes, (rows,))
    mine = slice(dist.get_rank() * rows // world_size, (dist.get_rank() + 1) * rows // world_size)

    def alone_on(x, y):
        model = ex.mlp.MLP(config)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x)[0], y).backward()
            optimizer.step()

        return step, model, optimizer

    parallel = ex.tp.ParallelMLP(list(ex.mlp.MLP(config).layers))
    tp_optimizer = torch.optim.SGD(parallel.parameters(), lr=0.01)
    data_step, model, optimizer = alone_on(x[mine], y[mine])

    def data_parallel():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[mine])[0], y[mine]).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        optimizer.step()

    return {
        "tensor parallel": lambda: ex.tp.train_step(parallel, tp_optimizer, x, y),
        "data parallel": data_parallel,
        "tensor parallel, compute alone": blocks_alone(parallel, x, y),
        "data parallel, compute alone": data_step,
    }


def blocks_alone(parallel, x, y):
    """A step of this rank's blocks of the weights on every row, as tensor parallelism runs them, without
    its all-reduces: a column layer's output block feeds the row layer's block straight away."""
    return products_alone([nn.Parameter(layer.weight.detach().clone()) for layer in parallel.layers], x, y)


def measure(folder, rounds, per_round):
    """On every rank of one world: the ping-pongs, and each batch's steps; seconds, the slowest rank's."""
    ex = impl.load(folder)
    config = ex.mlp.ModelConfig()
    out = {"message": [ex.cost.message_seconds(n) for n in SIZES], "batches": {}}
    for rows in BATCHES:
        fastest, median = interleaved(steps(ex, config, rows), rounds, per_round)
        out["batches"][rows] = {name: {"fastest": fastest[name], "median": median[name]} for name in fastest}
    model = ex.mlp.MLP(config)
    out["grad_bytes"] = [p.numel() * p.element_size() for p in model.parameters()]
    # What tensor parallelism all-reduces per row: both blocks' outputs, and the second block's input gradient.
    out["tp_bytes_per_row"] = [4 * config.d_hidden, 4 * config.n_classes, 4 * config.d_hidden]
    return out


def predict(cost, figures, world_size):
    alpha, beta = cost.fit_alpha_beta(SIZES, figures["message"])
    ring = lambda n: cost.ring_allreduce_seconds(n, world_size, alpha, beta)  # noqa: E731
    sync_dp = sum(ring(n) for n in figures["grad_bytes"])
    sync_tp = lambda rows: sum(ring(rows * n) for n in figures["tp_bytes_per_row"])  # noqa: E731
    predicted = {}
    for rows, got in figures["batches"].items():
        predicted[rows] = {
            "tensor parallel": got["tensor parallel, compute alone"]["fastest"] + sync_tp(rows),
            "data parallel": got["data parallel, compute alone"]["fastest"] + sync_dp,
        }
    return {
        "alpha_s": alpha,
        "beta_bytes_per_s": beta,
        "predicted": predicted,
        "crossover_bytes": sum(figures["grad_bytes"]) / sum(figures["tp_bytes_per_row"]),
    }


def crossover(rows, tensor, data):
    """The batch (rows) from which data parallelism stays the faster: the last change from tensor to data
    parallelism, interpolated on log scales; None if data parallelism is not the faster at the end."""
    gaps = [math.log(d / t) for t, d in zip(tensor, data)]  # > 0 where tensor parallelism wins
    if gaps[-1] > 0:
        return None
    for i in range(len(rows) - 1, 0, -1):
        if gaps[i - 1] > 0 >= gaps[i]:
            share = gaps[i - 1] / (gaps[i - 1] - gaps[i])
            return math.exp(math.log(rows[i - 1]) + share * (math.log(rows[i]) - math.log(rows[i - 1])))
    return rows[0]  # data parallelism is the faster throughout


def summary(results):
    lines = []
    for w, got in results.items():
        lines.append(
            f"W={w}: alpha {got['alpha_s'] * 1e6:.0f} us, beta {got['beta_bytes_per_s'] / 1e9:.2f} GB/s;"
            " fastest step in ms, measured (predicted)"
        )
        lines.append(f"  {'rows':>6}" + "".join(f"{v:>26}" for v in VARIANTS) + f"{'T_comp TP':>11}{'T_comp DP':>11}")
        for rows in BATCHES:
            measured, predicted = got["batches"][rows], got["predicted"][rows]
            cells = [f"{measured[v]['fastest'] * 1e3:9.2f} ({predicted[v] * 1e3:8.2f})" for v in VARIANTS]
            lines.append(
                f"  {rows:>6}"
                + "".join(f"{c:>26}" for c in cells)
                + "".join(f"{measured[f'{v}, compute alone']['fastest'] * 1e3:11.2f}" for v in VARIANTS)
            )
        said = {k: f"{v:.0f} rows" if v else "none in range" for k, v in got["crossover"].items()}
        ratio = got["crossover"]["measured"] / got["crossover"]["predicted"] if all(got["crossover"].values()) else None
        lines.append(
            f"  data parallelism faster from: measured {said['measured']}, predicted {said['predicted']}"
            + (f" (measured / predicted {ratio:.2f})" if ratio else "")
            + f"; the bytes alone: {got['crossover_bytes']:.0f} rows"
        )
    return "\n".join(lines)


def draw(ax, w, got):
    """One world's panel: each variant's steps by batch, measured and predicted, and where DP becomes the faster."""
    for variant, colour in zip(VARIANTS, ("tab:blue", "tab:orange")):
        measured = [got["batches"][rows][variant]["fastest"] * 1e3 for rows in BATCHES]
        predicted = [got["predicted"][rows][variant] * 1e3 for rows in BATCHES]
        ax.plot(BATCHES, measured, "o-", color=colour, label=f"{variant}, measured")
        ax.plot(BATCHES, predicted, "--", color=colour, label=f"{variant}, predicted")
    for at, style in ((got["crossover"]["measured"], "-"), (got["crossover"]["predicted"], "--")):
        if at:
            ax.axvline(at, color="grey", linestyle=style, linewidth=0.8)
    ax.axvline(got["crossover_bytes"], color="grey", linestyle=":", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows per step, all ranks together")
    ax.set_ylabel("fastest step (ms)")
    ax.set_title(
        f"default MLP on {w} ranks (gloo, this machine). Grey: DP the faster from here,\n"
        "measured (solid), predicted (dashed), the bytes alone (dotted)"
    )
    ax.title.set_fontsize(9)


def main(rounds=8, per_round=2):
    folder = impl.selected()
    cost = impl.load(folder).cost
    record = Record("tp")
    results = {}
    for w in WORLD_SIZES:
        figures = run(measure, w, folder, rounds, per_round, debug=False)[0]
        figures |= predict(cost, figures, w)
        figures["crossover"] = {
            "measured": crossover(BATCHES, *([figures["batches"][r][v]["fastest"] for r in BATCHES] for v in VARIANTS)),
            "predicted": crossover(BATCHES, *([figures["predicted"][r][v] for r in BATCHES] for v in VARIANTS)),
        }
        results[w] = figures
    record.write(
        summary(results),
        {"implementation": os.path.relpath(folder), "results": results},
        partial(side_by_side, results, draw=draw),
    )


if __name__ == "__main__":
    bench(main)
