"""Exercise 16: two dimensions at once, data x tensor parallel on a mesh of process sub-groups.

    python nd.py --dp 2 --tp 2      # 4 ranks: 2 copies of the model, each split over 2 ranks
    python nd.py --dp 4 --tp 1      # data parallel only; --dp 1 --tp 4: tensor parallel only

Exercise 14 split every layer over all the ranks, exercise 13 sharded every parameter over all
the ranks. Real training does both at once: the W = dp * tp ranks form a grid of dp rows and tp
columns, rank r at row r // tp, column r % tp. The ranks of one row hold one copy of the model
between them, each its block of every layer (tensor parallel, exercise 14): the row is a tp
group, and the layers' all-reduces go to it alone. The ranks of one column hold the same block,
and each keeps 1/dp of it, as a flat shard (exercise 13): the column is a dp group, and the
gathers of the block and the reduce-scatters of its gradient go to it alone. A batch is split over
the dp groups' ranks; the ranks of one tp group run the same rows.

The one new idea is the groups: which ranks a collective goes to. Everything else is restated
here from exercises 13 and 14, so that this file reads alone. Each rank trains its pieces; rank 0
also trains the whole MLP alone on the whole batches and prints both losses.

Handout: exercises/16_nd.md.
"""

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course.device import current_device, synchronize
from course.flags import whole
from course.launch import launch, launch_options
from mlp import MLP, ModelConfig, batches, config_from, gen_dataset, make_parser, split_dataset

# --- The mesh: the grid of ranks and its two families of groups ----------------------------------


@dataclass
class Mesh:
    """grid[i][j]: the world rank at row i, column j. This rank sits at row dp_rank, column tp_rank;
    tp_group holds the ranks of its row, dp_group those of its column (dist.new_group's groups)."""

    grid: list
    dp_rank: int
    tp_rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup

    @property
    def dp(self) -> int:
        return len(self.grid)

    @property
    def tp(self) -> int:
        return len(self.grid[0])


def mesh_groups(dp: int, tp: int) -> Mesh:
    """The mesh of dp rows and tp columns over the world's dp * tp ranks (else a ValueError naming
    both and the world size): rank r at row r // tp, column r % tp, as torch's
    init_device_mesh((dp, tp)) lays them out.

    dist.new_group is a collective of the whole world: every rank calls it for every group, its
    own or not, with the same ranks in the same order, and keeps the groups it belongs to. (With
    use_local_synchronization=True a group's members alone call it: torch pairs those calls by
    their ranks, not their order.)
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if dp * tp != world_size:
        raise ValueError(f"a mesh of dp {dp} x tp {tp} needs {dp * tp} ranks, the world has {world_size}")
    grid = [[i * tp + j for j in range(tp)] for i in range(dp)]
    # TODO(exercise 16): one group per row (tp), then one per column (dp); keep this rank's.
    ### BEGIN SOLUTION
    tp_group = dp_group = None
    for row in grid:
        group = dist.new_group(row)
        if rank in row:
            tp_group = group
    for column in zip(*grid):
        group = dist.new_group(list(column))
        if rank in column:
            dp_group = group
    return Mesh(grid, rank // tp, rank % tp, tp_group, dp_group)
    ### END SOLUTION


# --- Communication: each function's collective in the group given to it -------------------------


class Copy(torch.autograd.Function):
    """Into a tensor-parallel region (exercise 14): forward, x as it is; backward, the gradient
    summed over the ranks of `group`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        # TODO(exercise 16): the sum over the group's ranks of grad, in a tensor of its own (no gradient for group).
        ### BEGIN SOLUTION
        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=ctx.group)
        return total, None
        ### END SOLUTION


class AllReduce(torch.autograd.Function):
    """Out of a tensor-parallel region (exercise 14): forward, the sum over the ranks of `group` of
    their partial results; backward, the gradient as it is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        # TODO(exercise 16): the sum over the group's ranks of x, in a tensor of its own.
        ### BEGIN SOLUTION
        total = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return grad, None


class GatherShards(torch.autograd.Function):
    """A flat parameter from its shards (exercise 13): forward, the shards of the ranks of `group`
    one after the other, in the group's rank order (an all-gather); backward, this rank's piece of
    the gradient summed over the group's ranks (a reduce-scatter), the gradient of its shard."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        # TODO(exercise 16): a tensor of the group's size times the shard's elements, all-gathered.
        ### BEGIN SOLUTION
        full = shard.new_empty(shard.numel() * dist.get_world_size(group))
        dist.all_gather_into_tensor(full, shard.detach().contiguous(), group=group)
        return full
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        # TODO(exercise 16): this rank's piece of the sum over the group's ranks of grad.
        ### BEGIN SOLUTION
        mine = grad.new_empty(grad.numel() // dist.get_world_size(ctx.group))
        dist.reduce_scatter_tensor(mine, grad.contiguous(), group=ctx.group)
        return mine, None
        ### END SOLUTION


# --- The layers: a tensor-parallel block of each, sharded over its dp group -----------------------


def block(total: int, parts: int, index: int, what: str) -> slice:
    """Block `index` of `parts` equal blocks of `total` rows or features; a ValueError naming `what`
    and both sizes where parts does not divide total."""
    if total % parts:
        raise ValueError(f"{what}: {total} does not divide into {parts} equal blocks")
    size = total // parts
    return slice(index * size, (index + 1) * size)


class ShardedLinear(nn.Module):
    """This rank's block of `full`, an nn.Linear every rank built the same, tensor parallel over the
    mesh's tp group and sharded over its dp group.

    kind "column": block tp_rank of full's output features (its weight's rows, its bias);
    kind "row": block tp_rank of its input features (its weight's columns) and all of its bias,
    added once, after the tp group's sum. The block's tensors (weight, then bias) are flattened
    into one, padded with zeros to a multiple of dp, and this rank keeps piece dp_rank of it:
    self.shard, the one parameter. Its gradient after a backward is this rank's piece of the sum
    over the dp group of the block's gradients.
    """

    def __init__(self, full: nn.Linear, kind: str, mesh: Mesh) -> None:
        super().__init__()
        self.kind, self.mesh = kind, mesh
        if kind == "column":
            mine = block(full.out_features, mesh.tp, mesh.tp_rank, "a column layer's out_features")
            tensors = [full.weight[mine]] + ([] if full.bias is None else [full.bias[mine]])
        else:
            mine = block(full.in_features, mesh.tp, mesh.tp_rank, "a row layer's in_features")
            tensors = [full.weight[:, mine]] + ([] if full.bias is None else [full.bias])
        self.shapes = [t.shape for t in tensors]
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        padded = F.pad(flat, (0, -flat.numel() % mesh.dp))
        self.shard = nn.Parameter(padded.chunk(mesh.dp)[mesh.dp_rank].clone())

    def block_tensors(self) -> list:
        """The block's weight (and bias), views of the flat parameter gathered over the dp group."""
        full = GatherShards.apply(self.shard, self.mesh.dp_group)
        sizes = [math.prod(shape) for shape in self.shapes]
        return [piece.view(shape) for piece, shape in zip(full[: sum(sizes)].split(sizes), self.shapes)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, *bias = self.block_tensors()
        # TODO(exercise 16): exercise 14's layer: column, into the region then this rank's features; row, this
        # rank's partial product out of the region, then the bias once. Which group does each collective need?
        ### BEGIN SOLUTION
        if self.kind == "column":
            return F.linear(Copy.apply(x, self.mesh.tp_group), weight, *bias)
        out = AllReduce.apply(F.linear(x, weight), self.mesh.tp_group)
        return out + bias[0] if bias else out
        ### END SOLUTION


class MeshMLP(nn.Module):
    """Exercise 1's MLP on the mesh, from its full layers that every rank built the same: the layers
    pair up into blocks, a column layer, tanh, a row layer; tanh between blocks, none after the last.
    self.layers holds the ShardedLinears in the order of `layers`."""

    def __init__(self, layers: list, mesh: Mesh) -> None:
        super().__init__()
        if len(layers) % 2:
            raise ValueError(f"MeshMLP pairs the layers, a column and a row layer per block: {len(layers)} layers")
        self.mesh = mesh
        kinds = ("column", "row")
        self.layers = nn.ModuleList(ShardedLinear(layer, kinds[i % 2], mesh) for i, layer in enumerate(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = len(self.layers) // 2
        for k in range(blocks):
            x = self.layers[2 * k + 1](torch.tanh(self.layers[2 * k](x)))
            if k < blocks - 1:
                x = torch.tanh(x)
        return x


# --- Training ------------------------------------------------------------------------------------


def train_step(model: MeshMLP, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One optimizer step on the batch (x, y), which every rank holds whole; returns one process's
    loss on it (the mean cross-entropy over all its rows), on every rank.

    The rows are split over the dp group: the rank at row i of the mesh runs block i of them, the
    same rows as the other ranks of its tp group; where dp does not divide the rows, a ValueError
    naming both. The backward must leave every rank's shard the gradient of one process's loss on
    the whole batch.
    """
    mesh = model.mesh
    optimizer.zero_grad()
    # TODO(exercise 16): this rank's rows, the loss to backpropagate, and one process's loss, summed in which group?
    ### BEGIN SOLUTION
    rows = block(len(x), mesh.dp, mesh.dp_rank, "the batch's rows")
    share = F.cross_entropy(model(x[rows]), y[rows]) / mesh.dp
    share.backward()
    loss = share.detach().clone()
    dist.all_reduce(loss, group=mesh.dp_group)
    ### END SOLUTION
    optimizer.step()
    return loss.item()


def parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def train(config: ModelConfig, dp: int, tp: int) -> dict:
    """Train exercise 1's MLP on a dp x tp mesh; rank 0 also trains it alone, on the same whole
    batches, and prints both losses. Every rank's coordinates and bytes come back."""
    rank, device = dist.get_rank(), current_device()
    mesh = mesh_groups(dp, tp)
    torch.manual_seed(config.seed)  # the same full MLP on every rank: each keeps its pieces of it
    full = MLP(config).to(device)
    model = MeshMLP(list(full.layers), mesh)
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
    held = [mesh.dp_rank, mesh.tp_rank, parameter_bytes(model)]
    held.append(sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()))
    everyone = [torch.zeros(4, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, torch.tensor(held, device=device))
    return {
        "train_loss": loss,
        "one_process_loss": alone_loss.item() if alone is not None else None,
        "ranks": [dict(zip(("dp", "tp", "parameters", "gradients"), map(int, b))) for b in everyone],
        "full_bytes": parameter_bytes(MLP(config)),
        "step_ms": statistics.median(step_times),
    }


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--dp", type=whole(1), default=2, help="ranks that split the batch (a mesh's rows)")
    parser.add_argument("--tp", type=whole(1), default=2, help="ranks that split each layer (a mesh's columns)")
    parser.set_defaults(niters=200)
    args = parser.parse_args()
    if args.n_layers % 2:
        parser.error(f"--n-layers {args.n_layers}: the layers pair up, a column and a row layer per block")
    if args.world_size not in (1, args.dp * args.tp):  # 1: not given
        parser.error(f"--world-size {args.world_size} is not --dp {args.dp} x --tp {args.tp}: give --dp and --tp only")
    result = launch(train, args.dp * args.tp, config_from(args), args.dp, args.tp, **launch_options(args))[0]
    print(
        f"final | train_loss {result['train_loss']:.4f} | one process {result['one_process_loss']:.4f}"
        f" | median step time {result['step_ms']:.2f}ms"
    )
    for r, held in enumerate(result["ranks"]):
        print(
            f"rank {r} at (dp {held['dp']}, tp {held['tp']}): parameters {held['parameters']} B,"
            f" gradients {held['gradients']} B"
        )
    print(f"one process holds {result['full_bytes']} B of parameters")
