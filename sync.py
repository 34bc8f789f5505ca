# Your copy of the exercise code: fill in every TODO, then `make grade` checks it.
"""Exercise 9: what the ranks must agree on besides their gradients.

    python sync.py --world-size 2                  # BatchNorm on 2 ranks: per rank, synchronised, one process
    python sync.py --non-iid-plot non_iid.png      # test loss with IID and label-disjoint shards,
                                                   # synchronous and local SGD: a PNG and a JSON

BatchNorm normalises a batch with that batch's own mean and variance. When each rank holds part
of the batch, the ranks must share those statistics as they share gradients, or 2 ranks of B
rows are not one process of 2B rows. Local SGD lets every rank train alone for H steps and then
averages the parameters: what that costs when each rank sees other labels is the second lesson.
Handout: exercises/09_sync.md.
"""

import json
import os
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from course.device import current_device
from course.flags import whole
from course.launch import launch, launch_options
from mlp import MLP, ModelConfig, config_from, evaluate, gen_dataset, make_parser, split_dataset

# --- BatchNorm across ranks ---------------------------------------------------------------


def global_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, var) of the rows x (N, C) of all ranks together, per feature.

    count is the number of rows of all ranks (they may hold different numbers of rows, none on
    some), mean their mean and var their biased variance (divided by count). The backward pass
    must carry the gradient back through the communication to every rank whose rows made the
    statistics.
    """
    # TODO(exercise 9): count, sum and sum of squares of every rank's rows, summed over the ranks by
    # an all-reduce that autograd can pass gradients through; then the moments.
    raise NotImplementedError("Exercise 9: global_moments is not written yet, see exercises/09_sync.md")


class SyncBatchNorm1d(nn.Module):
    """nn.BatchNorm1d for rows (N, C) split across ranks: it normalises as one process would the
    rows of every rank together. Its parameters and buffers have nn.BatchNorm1d's names."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def normalise(self, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        """(x - mean) / sqrt(var + eps), then scaled by weight and shifted by bias, per feature."""
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias

    @torch.no_grad()
    def update_running_stats(self, count: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> None:
        """Move the running statistics towards this batch's, as nn.BatchNorm1d does.

        running = (1 - momentum) * running + momentum * statistic, where running_mean's statistic
        is mean and running_var's is the unbiased variance, var * count / (count - 1).
        """
        self.num_batches_tracked += 1
        # TODO(exercise 9): update running_mean and running_var in place.
        raise NotImplementedError(
            "Exercise 9: SyncBatchNorm1d.update_running_stats is not written yet, see exercises/09_sync.md"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Training mode: normalise with global_moments(x) and update the running statistics with
        them, identically on every rank. Eval mode: normalise with the running statistics, and
        communicate nothing: a model evaluated on one rank alone must not wait for the others."""
        # TODO(exercise 9): the two modes (self.training), with normalise and update_running_stats.
        raise NotImplementedError("Exercise 9: SyncBatchNorm1d.forward is not written yet, see exercises/09_sync.md")


def batchnorm_demo(rows_per_rank: int, features: int) -> dict:
    """On every rank: normalise this rank's rows with nn.BatchNorm1d and with SyncBatchNorm1d, and
    compare both with one process normalising every rank's rows; then rank 0 alone evaluates each
    layer in eval mode, as a script validates on rank 0 (nothing may wait for the other ranks).
    Rank 0 prints the differences."""
    rank, world_size, device = dist.get_rank(), dist.get_world_size(), current_device()
    g = torch.Generator().manual_seed(0)  # the same global batch on every rank; each takes its rows
    everything = (torch.randn(world_size * rows_per_rank, features, generator=g) * 3 + 1).to(device)
    mine = everything[rank * rows_per_rank : (rank + 1) * rows_per_rank]
    one_process = nn.BatchNorm1d(features).to(device)
    expected = one_process(everything)[rank * rows_per_rank : (rank + 1) * rows_per_rank]
    one_process.eval()
    found = {}
    for name, kind in (("nn.BatchNorm1d", nn.BatchNorm1d), ("SyncBatchNorm1d", SyncBatchNorm1d)):
        layer = kind(features).to(device)
        gaps = torch.stack(
            [
                (layer(mine) - expected).abs().max(),
                (layer.running_mean - one_process.running_mean).abs().max(),
                (layer.running_var - one_process.running_var).abs().max(),
            ]
        ).detach()
        dist.all_reduce(gaps, op=dist.ReduceOp.MAX)  # the largest over ranks
        found[name] = gaps.tolist()
        if rank == 0:
            layer.eval()
            evaluated = (layer(mine) - one_process(mine)).abs().max().item()
            found[name].append(evaluated)
            print(
                f"{name:>16} on {world_size} ranks of {rows_per_rank} rows, against one process on all"
                f" {world_size * rows_per_rank}: output differs by {gaps[0]:.2g}, running_mean by"
                f" {gaps[1]:.2g}, running_var by {gaps[2]:.2g}; evaluated on rank 0 alone, by {evaluated:.2g}"
            )
    return found


# --- Local SGD and non-IID shards ----------------------------------------------------------


def average_parameters(model: nn.Module) -> None:
    """Set every parameter of model to its mean over the ranks (dist.all_reduce), in the model's own
    Parameter objects: the optimizer holds those, and steps whatever values they have."""
    # TODO(exercise 9): all-reduce each parameter and divide by the world size, without autograd.
    raise NotImplementedError("Exercise 9: average_parameters is not written yet, see exercises/09_sync.md")


def local_sgd(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    period: int,
    before_average: Callable[[int], None] | None = None,
) -> list[float]:
    """Train on this rank's batches alone and average the parameters every `period` steps.

    One optimizer step per (x, y) of batches, on the model's loss (the model returns (logits,
    loss)). The parameters are averaged with average_parameters after steps period, 2 * period,
    ... and after the last step if it is not one of those, so that every rank ends with the same
    model. before_average, if given, is called with the number of steps taken just before each
    averaging. Returns the loss of every step, as floats. The ranks must start alike and have as
    many batches each.
    """
    # TODO(exercise 9): the loop; period=1 averages after every step.
    raise NotImplementedError("Exercise 9: local_sgd is not written yet, see exercises/09_sync.md")


def shard(Y: torch.Tensor, world_size: int, rank: int, non_iid: bool, seed: int) -> torch.Tensor:
    """The indices of this rank's training rows. IID: every world_size-th row of one shuffle.
    Non-IID: the rows whose labels are this rank's, a block of n_classes / world_size labels."""
    if not non_iid:
        return torch.randperm(len(Y), generator=torch.Generator().manual_seed(seed))[rank::world_size]
    labels_per_rank = -(-(int(Y.max()) + 1) // world_size)
    return torch.nonzero(Y // labels_per_rank == rank).flatten()


def draw_batches(X, Y, rows, batch_size, steps, seed):
    """`steps` batches of batch_size rows from rows, a new shuffle of them for each pass."""
    g = torch.Generator().manual_seed(seed)
    order = torch.cat(
        [rows[torch.randperm(len(rows), generator=g)] for _ in range(-(-steps * batch_size // len(rows)))]
    )
    return [(X[b], Y[b]) for b in order[: steps * batch_size].split(batch_size)]


SETTINGS = [(False, "sync"), (False, "local"), (True, "sync"), (True, "local")]


def non_iid_experiment(config: ModelConfig, period: int) -> dict:
    """On every rank: train from the same start on IID or label-disjoint shards, averaging every
    step (synchronous) or every `period` steps (local SGD). Rank 0 measures the test loss every
    `period` steps: of the averaged model, and for local SGD also of its own model just before."""
    rank, world_size, device = dist.get_rank(), dist.get_world_size(), current_device()
    train_set, test_set = split_dataset(*(t.to(device) for t in gen_dataset(config, rand_state=config.seed)))
    curves = {}
    for non_iid, how in SETTINGS:
        torch.manual_seed(config.seed)  # the same initial weights on every rank and in every setting
        model = MLP(config).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
        rows = shard(train_set[1], world_size, rank, non_iid, config.seed)
        batches = draw_batches(*train_set, rows, config.batch_size, config.niters, config.seed + 1 + rank)
        steps, averaged, before = [], [], []

        def measure_before(step, model=model, before=before):
            if rank == 0:
                before.append(evaluate(model, test_set))

        for start in range(0, config.niters, period):
            chunk = batches[start : start + period]
            local_sgd(
                model, optimizer, chunk, 1 if how == "sync" else period, measure_before if how == "local" else None
            )
            if rank == 0:
                steps.append(start + len(chunk))
                averaged.append(evaluate(model, test_set))
        curves[f"{'non-IID' if non_iid else 'IID'}, {how}"] = {"step": steps, "test_loss": averaged, "before": before}
    return curves


def plot(curves: dict, period: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, curve in curves.items():
        colour = "tab:red" if name.startswith("non") else "tab:blue"
        style = "-" if name.endswith("sync") else "--"
        label = name.replace("sync", "sync every step").replace("local", f"local SGD, H={period}")
        ax.plot(curve["step"], curve["test_loss"], style, color=colour, label=label)
        if curve["before"]:
            ax.plot(curve["step"], curve["before"], ":", color=colour, label=f"{label}: rank 0 before averaging")
    ax.set_xlabel("step")
    ax.set_ylabel("test loss")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def summary(curves: dict) -> dict:
    """The last test loss of each setting, and of rank 0's own model before the last averaging."""
    found = {name: curve["test_loss"][-1] for name, curve in curves.items()}
    found |= {
        f"{name}, rank 0 before averaging": curve["before"][-1] for name, curve in curves.items() if curve["before"]
    }
    return found


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--rows", type=whole(1), default=8, help="rows per rank of the BatchNorm demo")
    parser.add_argument(
        "--non-iid-plot", metavar="PNG", default=None, help="run the non-IID experiment; write PNG and its .json"
    )
    parser.add_argument(
        "--period", type=whole(1), default=8, help="local SGD: average the parameters every PERIOD steps"
    )
    # The experiment's own defaults: the default MLP, long enough for the curves to settle.
    parser.set_defaults(world_size=2, niters=600, learning_rate=0.2, time_limit=300)
    args = parser.parse_args()
    if args.non_iid_plot is None and args.rows * args.world_size < 2:
        parser.error("BatchNorm's variance needs 2 rows at least: --rows x --world-size is 1")
    if args.non_iid_plot is not None and args.n_classes < args.world_size:
        parser.error(
            f"label-disjoint shards give each rank its own classes: --n-classes {args.n_classes} is fewer"
            f" than the {args.world_size} ranks"
        )
    if args.non_iid_plot is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.non_iid_plot))):
        parser.error(f"--non-iid-plot {args.non_iid_plot}: no folder {os.path.dirname(args.non_iid_plot)}")
    if args.non_iid_plot is None:
        launch(batchnorm_demo, args.world_size, args.rows, args.dim_hidden, **launch_options(args))
        raise SystemExit(0)
    config = config_from(args)
    # Thousands of all-reduces: without the per-call comparison of the ranks' collectives, which
    # would double their cost (course/flags.py; the demo above keeps it).
    options = launch_options(args) | {"check_collectives": False}
    curves = launch(non_iid_experiment, args.world_size, config, args.period, **options)[0]
    found = summary(curves)
    stem = os.path.splitext(args.non_iid_plot)[0]
    with open(f"{stem}.json", "w") as f:
        json.dump({"config": asdict(config), "period": args.period, "final": found, "curves": curves}, f, indent=1)
    for name, loss in found.items():
        print(f"final test loss | {name:<40} {loss:.4f}")
    try:
        plot(curves, args.period, args.non_iid_plot)
        print(f"wrote {args.non_iid_plot} and {stem}.json")
    except ImportError:
        print(
            f"wrote {stem}.json; no {args.non_iid_plot}: matplotlib is not installed (python3 -m course setup --notebooks)"
        )

# ruff: noqa: F401, F821, F841, B007 - what a stub leaves unused or undefined until it is written
