# Your copy of the exercise code: fill in every TODO, then `make grade` checks it.
"""Exercise 8: split the data by fractions, weigh the gradients by shard, and end uneven shards cleanly.

    python data.py --world-size 2                  # shards of 0.7 and 0.3, batches in proportion
    python data.py --world-size 3 --fractions 0.5 0.3 0.2
    python data.py --world-size 2 --uneven hang    # equal batches on unequal shards: one rank waits
    python data.py --world-size 2 --uneven agree   # fix (a): agree on the number of steps first
    python data.py --world-size 2 --uneven join    # fix (b): built-in DDP under Join
    python data.py --world-size 2 --uneven async   # the async_op=True "fix": it ends, and is wrong

Handout: exercises/08_data.md.
"""

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from course.launch import launch, launch_options
from mlp import MLP, check_parameter_closeness, config_from, gen_dataset, make_parser, split_dataset


def shard_sizes(n: int, fractions: list[float]) -> list[int]:
    """Whole-number sizes, one per fraction, that add up to n; size k is n * fractions[k] rounded.

    The rounding rule (largest remainder): every shard first gets the whole part of
    n * fractions[k]; the samples left over go one each to the shards with the largest fractional
    parts, the lower rank first among equal ones. So every size is n * fractions[k] rounded down
    or up, and shard_sizes(10, [1/3, 1/3, 1/3]) == [4, 3, 3]. The fractions are positive and add
    up to 1.
    """
    # TODO(exercise 8): whole parts first, then the left-over samples by largest fractional part.
    raise NotImplementedError("Exercise 8: shard_sizes is not written yet, see exercises/08_data.md")


def partition(n: int, fractions: list[float], seed: int) -> list[torch.Tensor]:
    """Split the sample indices 0 .. n-1 into one shard per fraction: disjoint, covering all of them.

    Shuffle with torch.randperm(n, generator=torch.Generator().manual_seed(seed)), the order that
    torch's DistributedSampler(shuffle=True, seed=seed) draws in its first epoch, and cut it into
    consecutive pieces of shard_sizes(n, fractions), in rank order. Every rank calls it with the
    same arguments and gets the same shards, without communicating: no collective here. The global
    random generator (torch.manual_seed's) is the rank's own: leave it as it was.
    """
    # TODO(exercise 8): the shuffled indices, cut into pieces of shard_sizes(n, fractions).
    raise NotImplementedError("Exercise 8: partition is not written yet, see exercises/08_data.md")


def average_gradients_weighted(model: nn.Module, rows: int) -> None:
    """Replace every .grad by the gradient of the union batch: the sum over ranks of (m_k / n) g_k.

    This rank's loss is the mean over its own `rows` rows (m_k), so its gradient g_k is a mean
    over m_k rows. The union batch of n = m_0 + m_1 + ... rows has the gradient sum_k (m_k / n) g_k,
    not the plain mean of the g_k when the batches differ in size. No rank knows n: the ranks'
    row counts must travel first, by a collective (one all-reduce of them is enough), then the
    weighted gradients are summed over the ranks.
    """
    # TODO(exercise 8): n, the sum of the ranks' counts; then every gradient times m_k / n, summed over the ranks.
    raise NotImplementedError("Exercise 8: average_gradients_weighted is not written yet, see exercises/08_data.md")


def train_shard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    X: torch.Tensor,
    Y: torch.Tensor,
    shard: torch.Tensor,
    batch_size: int,
    steps: int | None = None,
    average: Callable[[nn.Module, int], None] = average_gradients_weighted,
) -> int:
    """Train on this rank's shard in batches of batch_size, averaging gradients after each backward pass.

    Without `steps`, a rank takes as many steps as its shard has whole batches: on shards of
    unequal size, ranks take different numbers of steps. Returns the number of steps taken.
    """
    if steps is None:
        steps = len(shard) // batch_size
    for step in range(steps):
        rows = shard[step * batch_size : (step + 1) * batch_size]
        optimizer.zero_grad()
        _, loss = model(X[rows], Y[rows])
        loss.backward()
        average(model, len(rows))  # one collective per call: every rank must call it as often
        optimizer.step()
    return steps


def common_steps(steps: int) -> int:
    """Fix (a): the number of steps every rank can take, the smallest of the ranks' `steps`.

    A collective before the training loop (an all-reduce with ReduceOp.MIN, for one); every rank
    returns the same number.
    """
    # TODO(exercise 8): the smallest steps over all ranks, the same on every rank.
    raise NotImplementedError("Exercise 8: common_steps is not written yet, see exercises/08_data.md")


def train_joined(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    X: torch.Tensor,
    Y: torch.Tensor,
    shard: torch.Tensor,
    batch_size: int,
) -> int:
    """Fix (b): train on every whole batch of this rank's shard with built-in DDP under Join.

    Wrap the model in DistributedDataParallel and run the loop inside
    `with Join([ddp_model]):` (torch.distributed.algorithms.Join). A rank that runs out of
    batches first keeps answering the others' all-reduces with zero gradients, and DDP still
    divides by the world size. `optimizer` holds `model`'s parameters, which DDP trains in place.
    Returns the number of steps this rank took.
    """
    steps = len(shard) // batch_size
    # TODO(exercise 8): DDP around the model, and the loop of train_shard inside Join, DDP averaging.
    raise NotImplementedError("Exercise 8: train_joined is not written yet, see exercises/08_data.md")
    return steps


def unchecked_group() -> dist.ProcessGroup:
    """A process group of all ranks whose collectives the ranks do not compare first (the launcher
    compares those of every group but one whose description starts with "unchecked"; the reference
    notebook ran without the comparison, which would line the ranks up at every all-reduce)."""
    return dist.new_group(group_desc="unchecked: the notebook's unwaited all-reduces")


def average_gradients_unwaited(model: nn.Module, rows: int, group: dist.ProcessGroup | None = None) -> None:
    """The reference notebook's "fix" (do not copy it): start each all-reduce and never wait for it.

    async_op=True returns at once with a request; the sum lands in .grad whenever the request
    completes, before or after the optimizer has read .grad, or never, if no peer joins it.
    """
    world_size = dist.get_world_size()
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group, async_op=True)  # the request is dropped
        param.grad.div_(world_size)


def drain_unwaited(steps: int, model: nn.Module, group: dist.ProcessGroup) -> None:
    """After average_gradients_unwaited on `group`: join, with zeros, the all-reduces that ranks
    with more steps left open, so that this run can end and compare ranks (the notebook's just ended)."""
    most = torch.tensor([steps])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    for _ in range(int(most.item()) - steps):
        for param in model.parameters():
            dist.all_reduce(torch.zeros_like(param), group=group)
    dist.barrier(group=group)


def train_on_fractions(config, fractions: list[float], uneven: str | None = None) -> dict:
    """Run on every rank: train the MLP on this rank's fraction of the data; return what happened.

    Without `uneven`, each rank's batch is its fraction of world_size * batch_size rows, so every
    rank has about as many batches, and the ranks agree on the number of steps. With `uneven`,
    every rank takes batches of batch_size: "hang" as it is, "agree" with fix (a), "join" with fix
    (b), "async" with the notebook's unwaited all-reduces.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.seed)  # the same start on every rank: no wrapper broadcasts here
    (X, Y), test_set = split_dataset(*gen_dataset(config, rand_state=config.seed))
    shard = partition(len(X), fractions, config.seed)[rank]
    model = MLP(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    if uneven is None:
        batch = shard_sizes(world_size * config.batch_size, fractions)[rank]  # m_k, in proportion to the shard
        steps = train_shard(model, optimizer, X, Y, shard, batch, steps=common_steps(len(shard) // batch))
    elif uneven == "hang":
        batch, steps = config.batch_size, train_shard(model, optimizer, X, Y, shard, config.batch_size)
    elif uneven == "agree":
        batch = config.batch_size
        steps = train_shard(model, optimizer, X, Y, shard, batch, steps=common_steps(len(shard) // batch))
    elif uneven == "join":
        batch, steps = config.batch_size, train_joined(model, optimizer, X, Y, shard, config.batch_size)
    elif uneven == "async":
        batch, group = config.batch_size, unchecked_group()
        unwaited = partial(average_gradients_unwaited, group=group)
        steps = train_shard(model, optimizer, X, Y, shard, batch, average=unwaited)
        drain_unwaited(steps, model, group)
    else:
        raise ValueError(f"unknown --uneven {uneven!r}")
    with torch.no_grad():
        _, test_loss = model(*test_set)
    return {
        "rank": rank,
        "shard": len(shard),
        "batch": batch,
        "steps": steps,
        "test_loss": test_loss.item(),
        "parameters_close": check_parameter_closeness(model),
    }


def default_fractions(world_size: int) -> list[float]:
    """0.7 and 0.3 on two ranks; on W ranks, shares in proportion to W, W - 1, ..., 1."""
    if world_size == 2:
        return [0.7, 0.3]
    return [(world_size - r) / (world_size * (world_size + 1) / 2) for r in range(world_size)]


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.set_defaults(world_size=2, n_layers=3, dim_in=32, n_classes=4, dim_hidden=32, batch_size=16)
    parser.set_defaults(train_size=2000, learning_rate=0.2)
    # The counts, steps and gradients of this lesson are CPU tensors, which gloo moves and nccl does not.
    parser.set_defaults(device="cpu")
    parser.add_argument("--fractions", type=float, nargs="+", default=None, help="one per rank, adding up to 1")
    parser.add_argument("--uneven", choices=("hang", "agree", "join", "async"), default=None)
    args = parser.parse_args()
    if args.device != "cpu" or args.backend == "nccl":
        parser.error(
            "the counts and steps this script all-reduces are CPU tensors, which nccl does not move: --device cpu"
        )
    fractions = args.fractions or default_fractions(args.world_size)
    if len(fractions) != args.world_size or abs(sum(fractions) - 1) > 1e-6 or min(fractions) <= 0:
        parser.error(f"--fractions needs {args.world_size} positive numbers that add up to 1, got {fractions}")
    if args.uneven is None and min(fractions) * args.world_size * args.batch_size < 1:
        parser.error(
            f"--fractions {fractions}: a rank's batch, its fraction of --world-size x --batch-size"
            f" = {args.world_size * args.batch_size} rows, would hold no row: raise --batch-size"
        )
    results = launch(
        train_on_fractions, args.world_size, config_from(args), fractions, args.uneven, **launch_options(args)
    )
    for r in results:
        print(f"rank {r['rank']}: {r['shard']} samples, batches of {r['batch']}, {r['steps']} steps")
    print(f"test loss {results[0]['test_loss']:.4f} | parameters close across ranks: {results[0]['parameters_close']}")

# ruff: noqa: F401, F821, F841, B007 - what a stub leaves unused or undefined until it is written
