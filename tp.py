# Your copy of the exercise code: fill in every TODO, then `make grade` checks it.
"""Exercise 14: tensor and sequence parallelism, forward and backward, built on exercise 2.

    python tp.py --world-size 2                        # each rank holds 1/W of every layer
    python tp.py --world-size 2 --sequence-parallel    # and between blocks, 1/W of the rows

Exercise 2 split a matrix product by rows (each rank a block of C, gathered) and by the reduction
dimension (each rank a partial product, summed by all_reduce). A linear layer is such a product:
split by its output features it is the column-parallel layer, split by its input features the
row-parallel layer. Put one after the other and the first one's output block is exactly the input
block the second one needs: one all-reduce per pair of layers, forward, and one backward.
Every rank builds the same full model from the same seed and keeps its blocks of it, so the
training equals one process; rank 0 trains that one process beside it and prints both losses.

Handout: exercises/14_tp.md.
"""

import copy
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course.device import current_device, synchronize
from course.launch import launch, launch_options
from dist import block_sizes
from mlp import MLP, ModelConfig, batches, config_from, gen_dataset, make_parser, split_dataset

# --- Communication: four autograd functions, one collective each way --------------------------------


class Copy(torch.autograd.Function):
    """Into a parallel region: forward, x as it is; backward, the gradient summed over the ranks.

    Every rank holds the same x and computes its own part of what follows from it, so each rank's
    backward pass finds only its own part's share of x's gradient: x's gradient is their sum
    (dist.all_reduce).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        # TODO(exercise 14): one process's x, unchanged.
        raise NotImplementedError("Exercise 14: Copy.forward is not written yet, see exercises/14_tp.md")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # TODO(exercise 14): the sum over the ranks of grad, in a tensor of its own.
        raise NotImplementedError("Exercise 14: Copy.backward is not written yet, see exercises/14_tp.md")


class AllReduce(torch.autograd.Function):
    """Out of a parallel region: forward, the sum over the ranks of their partial results
    (dist.all_reduce); backward, the gradient as it is.

    Every rank goes on with the same sum, so every rank finds the sum's whole gradient, and a sum
    passes its gradient to each of its terms unchanged.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        # TODO(exercise 14): the sum over the ranks of x, in a tensor of its own.
        raise NotImplementedError("Exercise 14: AllReduce.forward is not written yet, see exercises/14_tp.md")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # TODO(exercise 14): the gradient of each term of a sum.
        raise NotImplementedError("Exercise 14: AllReduce.backward is not written yet, see exercises/14_tp.md")


class AllGatherRows(torch.autograd.Function):
    """Into a parallel region from blocks of rows: forward, every rank's rows (n, ...) stacked in
    rank order, (W n, ...) on every rank (dist.all_gather_into_tensor); backward, rank r's block of rows
    of the gradient, summed over the ranks (dist.reduce_scatter_tensor).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        # TODO(exercise 14): all the ranks' rows, rank 0's first.
        raise NotImplementedError("Exercise 14: AllGatherRows.forward is not written yet, see exercises/14_tp.md")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # TODO(exercise 14): this rank's rows of the sum over the ranks of grad.
        raise NotImplementedError("Exercise 14: AllGatherRows.backward is not written yet, see exercises/14_tp.md")


class ReduceScatterRows(torch.autograd.Function):
    """Out of a parallel region into blocks of rows: forward, rank r's block of rows of the sum over
    the ranks of x (W n, ...), (n, ...) on rank r (dist.reduce_scatter_tensor); backward, every
    rank's block of the gradient stacked in rank order (dist.all_gather_into_tensor).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        # TODO(exercise 14): this rank's rows of the sum over the ranks of x.
        raise NotImplementedError("Exercise 14: ReduceScatterRows.forward is not written yet, see exercises/14_tp.md")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # TODO(exercise 14): all the ranks' blocks of grad, rank 0's first.
        raise NotImplementedError("Exercise 14: ReduceScatterRows.backward is not written yet, see exercises/14_tp.md")


# --- The layers ------------------------------------------------------------------------------------


def my_block(total: int, what: str) -> slice:
    """This rank's block of `total` rows or features, as a slice: rank r's block of
    block_sizes(total, W) (exercise 2). W must divide total, so that every rank gets as many:
    otherwise a ValueError that names `what`, total and W.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # TODO(exercise 14): the error for uneven blocks, then the slice.
    raise NotImplementedError("Exercise 14: my_block is not written yet, see exercises/14_tp.md")


class ColumnParallelLinear(nn.Module):
    """Rank r's block of the output features of `full`, an nn.Linear every rank built the same.

    self.weight: new parameters holding the rows my_block(out_features) of full.weight, whose
    shape is (out_features, in_features); self.bias: the same block of full.bias, or None.
    forward(x): x holds every row (tensor parallel) or this rank's block of the rows (sequence
    parallel); returns every row of this rank's block of the output features.
    """

    def __init__(self, full: nn.Linear, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        # TODO(exercise 14): self.weight and self.bias, this rank's block of full's.
        raise NotImplementedError(
            "Exercise 14: ColumnParallelLinear.__init__ is not written yet, see exercises/14_tp.md"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO(exercise 14): into the parallel region (Copy, or AllGatherRows), then this rank's features.
        raise NotImplementedError(
            "Exercise 14: ColumnParallelLinear.forward is not written yet, see exercises/14_tp.md"
        )


class RowParallelLinear(nn.Module):
    """Rank r's block of the input features of `full`, an nn.Linear every rank built the same.

    self.weight: new parameters holding the columns my_block(in_features) of full.weight;
    self.bias: all of full.bias, or None, added once, to the sum. forward(x): x holds every row of
    this rank's block of the input features (a ColumnParallelLinear's output, after an activation);
    returns the whole output, of every row (tensor parallel) or of this rank's block of the rows
    (sequence parallel). Either way the backward pass leaves every rank one process's whole
    gradient of the bias.
    """

    def __init__(self, full: nn.Linear, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        # TODO(exercise 14): self.weight and self.bias.
        raise NotImplementedError("Exercise 14: RowParallelLinear.__init__ is not written yet, see exercises/14_tp.md")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO(exercise 14): this rank's partial product, out of the parallel region (AllReduce, or
        # ReduceScatterRows), then the bias, once. Sequence parallel, the bias meets this rank's rows only.
        raise NotImplementedError("Exercise 14: RowParallelLinear.forward is not written yet, see exercises/14_tp.md")


class ParallelMLP(nn.Module):
    """Exercise 1's MLP, tensor parallel, from its full layers (and LayerNorms, if any) that every
    rank built the same.

    The layers pair up into blocks: ColumnParallelLinear, tanh, RowParallelLinear; tanh between
    blocks, none after the last, as in exercise 1. norms[k], when given, normalises the input of
    block k. self.layers holds the parallel layers in the order of `layers` and self.norms copies
    of the norms, so the parameters keep the full model's names (layers.0.weight, norms.0.bias).
    Sequence parallel, forward takes and returns this rank's block of the rows, and the norms run
    on those rows only. The backward pass leaves each rank its part of one process's gradients:
    its blocks of the layers' weights, and the norms' whole gradients.
    """

    def __init__(
        self, layers: list[nn.Linear], norms: list[nn.LayerNorm] | None = None, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        if len(layers) % 2:
            raise ValueError(f"ParallelMLP pairs the layers, a column and a row layer per block: {len(layers)} layers")
        if norms is not None and len(norms) != len(layers) // 2:
            raise ValueError(f"one norm per block: {len(norms)} norms for {len(layers) // 2} blocks")
        self.sequence_parallel = sequence_parallel
        self.norms = None if norms is None else nn.ModuleList(copy.deepcopy(norm) for norm in norms)
        # TODO(exercise 14): self.layers, an nn.ModuleList: column, row, column, row, ...
        raise NotImplementedError("Exercise 14: ParallelMLP.__init__ is not written yet, see exercises/14_tp.md")

    def normalise(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """norms[k] on x, whatever its eps, and with or without a weight and a bias. Sequence parallel, x is
        this rank's rows: a LayerNorm normalises each row by itself, so the rows need no other rank's; but its
        weight and bias are used on this rank's rows only."""
        norm = self.norms[k]
        # TODO(exercise 14): F.layer_norm with the norm's shape, weight, bias and eps.
        raise NotImplementedError("Exercise 14: ParallelMLP.normalise is not written yet, see exercises/14_tp.md")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO(exercise 14): block by block: normalise (if there are norms), column, tanh, row; tanh between blocks.
        raise NotImplementedError("Exercise 14: ParallelMLP.forward is not written yet, see exercises/14_tp.md")


# --- Training ------------------------------------------------------------------------------------


def train_step(model: ParallelMLP, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One optimizer step on the batch (x, y), which every rank holds whole; returns one process's
    loss on it (the mean cross-entropy over all the rows), on every rank.

    Tensor parallel, every rank runs every row and finds the same loss. Sequence parallel, rank r
    runs its block of the rows (my_block) only, and the backward pass must still give the
    gradients of one process's loss.
    """
    optimizer.zero_grad()
    # TODO(exercise 14): the rows this rank runs, and the loss to backpropagate and return.
    raise NotImplementedError("Exercise 14: train_step is not written yet, see exercises/14_tp.md")
    optimizer.step()
    return loss.item()


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def train(config: ModelConfig, sequence_parallel: bool = False) -> dict:
    """Train exercise 1's MLP tensor parallel (or sequence parallel too), every rank on every batch;
    rank 0 also trains the MLP alone, on the same batches, and prints both losses."""
    rank, world_size, device = dist.get_rank(), dist.get_world_size(), current_device()
    torch.manual_seed(config.seed)  # the same full MLP on every rank: each keeps its blocks of it
    full = MLP(config).to(device)
    model = ParallelMLP(list(full.layers), sequence_parallel=sequence_parallel)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    alone = torch.optim.SGD(full.parameters(), lr=config.lr) if rank == 0 else None
    train_set, _ = split_dataset(*(t.to(device) for t in gen_dataset(config, rand_state=config.seed)))
    step_times = []
    for step, x, y in batches(*train_set, config.batch_size, config.seed):
        if step == config.niters:
            break
        synchronize(device)
        t0 = time.perf_counter()
        loss = train_step(model, optimizer, x, y)
        synchronize(device)
        step_times.append((time.perf_counter() - t0) * 1000)
        if alone is not None:
            alone.zero_grad()
            _, alone_loss = full(x, y)
            alone_loss.backward()
            alone.step()
            if step % 100 == 0:
                print(f"step {step} | train_loss {loss:.4f} | one process {alone_loss.item():.4f}")
    mine = torch.tensor([parameter_bytes(model)], device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    return {
        "train_loss": loss,
        "one_process_loss": alone_loss.item() if alone is not None else None,
        "weight_bytes": [int(b) for b in everyone],
        "full_bytes": parameter_bytes(MLP(config)),
        "step_ms": statistics.median(step_times),
    }


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--sequence-parallel", action="store_true", help="split the rows between blocks too")
    parser.set_defaults(world_size=2)
    args = parser.parse_args()
    if args.n_layers % 2:
        parser.error(f"--n-layers {args.n_layers}: the layers pair up, a column and a row layer per block")
    result = launch(train, args.world_size, config_from(args), args.sequence_parallel, **launch_options(args))[0]
    print(
        f"final | train_loss {result['train_loss']:.4f} | one process {result['one_process_loss']:.4f}"
        f" | median step time {result['step_ms']:.2f}ms"
    )
    shares = ", ".join(f"rank {r} {b} B" for r, b in enumerate(result["weight_bytes"]))
    print(f"weights per rank: {shares}; one process holds {result['full_bytes']} B")

# ruff: noqa: F401, F821, F841, B007 - what a stub leaves unused or undefined until it is written
