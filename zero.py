# Your copy of the exercise code: fill in every TODO, then `make grade` checks it.
"""Exercise 11: shard the optimizer state over the ranks (ZeRO stage 1), and a DDP communication hook.

    python zero.py --world-size 2               # sharded Adam: each rank keeps 1/W of its state
    python zero.py --world-size 2 --bf16-hook   # built-in DDP, gradients all-reduced in bfloat16

Adam keeps two float32 tensors per parameter, twice the model's own size, and in exercises 3 to
10 every rank keeps all of it. Here each parameter gets one owner: only the owner keeps its
optimizer state and steps it, then sends the new values to everyone.

Handout: exercises/11_zero.md.
"""

import statistics
import time

import torch
import torch.distributed as dist

from course.flags import check_batch_fits
from course.launch import launch, launch_options
from mlp import (
    MLP,
    ModelConfig,
    batches,
    check_parameter_closeness,
    config_from,
    evaluate,
    gen_dataset,
    make_parser,
    report,
    split_dataset,
)

# Part A: ZeRO stage 1, a sharded optimizer.


def assign_owners(sizes: list[int], world_size: int) -> list[int]:
    """The owner rank of each parameter, from the parameters' sizes (numbers of elements).

    Balance the ranks by size: take the parameters largest first (equal sizes in their order),
    and give each to the rank that owns the fewest elements so far (a tie goes to the lower rank).
    """
    # TODO(exercise 11): a list as long as sizes, each entry a rank in range(world_size).
    raise NotImplementedError("Exercise 11: assign_owners is not written yet, see exercises/11_zero.md")


class ShardedOptimizer:
    """Any torch optimizer, with its state split over the ranks: ShardedOptimizer(params, torch.optim.Adam, lr=1e-3).

    Every rank holds every parameter, but the wrapped optimizer of a rank sees only the parameters
    that rank owns (assign_owners), so it keeps state for those only. step() averages the
    gradients, steps the owned parameters, and gives every rank each owner's new values.
    """

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer], **defaults) -> None:
        self.params = list(params)
        world_size = dist.get_world_size()
        if len(self.params) < world_size:
            raise ValueError(f"{len(self.params)} parameters cannot give each of {world_size} ranks one to own")
        self.owners = assign_owners([p.numel() for p in self.params], world_size)
        # TODO(exercise 11): the wrapped optimizer, over this rank's own parameters only.
        raise NotImplementedError("Exercise 11: ShardedOptimizer.__init__ is not written yet, see exercises/11_zero.md")

    @property
    def state(self) -> dict:
        """This rank's optimizer state: its own parameters' only."""
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def average_gradients(self) -> None:
        """Replace every parameter's gradient by its mean over the ranks (dist.all_reduce); a frozen one has none."""
        # TODO(exercise 11): every rank needs the average: the owner steps with it.
        raise NotImplementedError(
            "Exercise 11: ShardedOptimizer.average_gradients is not written yet, see exercises/11_zero.md"
        )

    def share_parameters(self) -> None:
        """Give every rank each parameter's values from the parameter's owner (dist.broadcast)."""
        # TODO(exercise 11): every rank calls the same broadcasts in the same order, each from its owner.
        raise NotImplementedError(
            "Exercise 11: ShardedOptimizer.share_parameters is not written yet, see exercises/11_zero.md"
        )

    def step(self) -> None:
        self.average_gradients()
        self.optimizer.step()  # the owned parameters only
        self.share_parameters()


def state_bytes(optimizer) -> int:
    """The bytes of the tensors in an optimizer's state (Adam: step, exp_avg, exp_avg_sq per parameter)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))


# Part B: a communication hook for built-in DDP.


def bf16_average_hook(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce of one bucket of gradients, sent in bfloat16: return a future of the average.

    Register it with ddp_model.register_comm_hook(ddp_model.process_group, bf16_average_hook):
    DDP calls it with that group for every bucket, as soon as the bucket's gradients are ready.
    One all-reduce per bucket, in bfloat16, started without waiting for it (async_op=True): the
    backward pass goes on while it runs. The future's value becomes the bucket's gradients.
    """
    # TODO(exercise 11): bucket.buffer() is the bucket's flat float32 gradients.
    raise NotImplementedError("Exercise 11: bf16_average_hook is not written yet, see exercises/11_zero.md")


def train(config: ModelConfig, bf16_hook: bool = False) -> dict:
    """Train the MLP with Adam, data-parallel; return final figures and each rank's optimizer-state bytes.

    Without bf16_hook: the model is not wrapped, a ShardedOptimizer averages and shards. With it:
    built-in DDP with bf16_average_hook and a plain Adam. Batch i belongs to rank i % world_size.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.seed)  # the same weights on every rank: nothing broadcasts them first
    train_set, test_set = split_dataset(*gen_dataset(config, rand_state=config.seed))
    model = MLP(config)
    if bf16_hook:
        forward = torch.nn.parallel.DistributedDataParallel(model)
        forward.register_comm_hook(forward.process_group, bf16_average_hook)
        optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    else:
        forward, optimizer = model, ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=config.lr)
    step, step_times = 0, []
    for i, x, y in batches(*train_set, config.batch_size, config.seed):
        if step == config.niters:
            break
        if i % world_size != rank:
            continue
        t0 = time.perf_counter()
        optimizer.zero_grad()
        _, loss = forward(x, y)
        loss.backward()
        optimizer.step()
        step_times.append((time.perf_counter() - t0) * 1000)
        if rank == 0 and step % 100 == 0:
            print(f"step {step} | train_loss {loss.item():.4f} | test_loss {evaluate(model, test_set):.4f}")
        step += 1
    mine = torch.tensor([state_bytes(optimizer)])
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    return {
        "train_loss": loss.item(),
        "test_loss": evaluate(model, test_set),
        "parameters_close": check_parameter_closeness(model),
        "step_ms": statistics.median(step_times),
        "state_bytes": [int(b) for b in everyone],
    }


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--bf16-hook", action="store_true", help="built-in DDP, gradients all-reduced in bfloat16")
    parser.set_defaults(learning_rate=0.001)
    args = parser.parse_args()
    check_batch_fits(parser, args.batch_size, len(split_dataset(range(args.train_size), range(args.train_size))[0][0]))
    if not args.bf16_hook and args.n_layers < args.world_size:
        parser.error(
            f"the sharded optimizer gives each rank a parameter to own: --n-layers {args.n_layers} makes fewer"
            f" parameters than the {args.world_size} ranks"
        )
    result = launch(train, args.world_size, config_from(args), args.bf16_hook, **launch_options(args))[0]
    report(result)
    print(f"optimizer state per rank: {', '.join(f'rank {r} {b} B' for r, b in enumerate(result['state_bytes']))}")

# ruff: noqa: F401, F821, F841, B007 - what a stub leaves unused or undefined until it is written
