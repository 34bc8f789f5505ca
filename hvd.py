# Your copy of the exercise code: fill in every TODO, then `make grade` checks it.
"""Exercise 10: data parallelism from the optimizer's side, the way Horovod does it.

    python hvd.py --world-size 2     # Adam with weight decay; the optimizer averages the gradients

No wrapper around the model: rank 0's weights and optimizer state are broadcast once, and the
optimizer averages the gradients in step(). Written as `import hvd`, a training script reads like
one written for Horovod (`hvd.broadcast_parameters(model)`, `hvd.DistributedOptimizer(opt)`).

Handout: exercises/10_hvd.md.
"""

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

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


def broadcast_parameters(model: nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers (dist.broadcast), in the model's own tensors:
    an optimizer built before holds the Parameter objects."""
    # TODO(exercise 10): every parameter and every buffer, from rank 0.
    raise NotImplementedError("Exercise 10: broadcast_parameters is not written yet, see exercises/10_hvd.md")


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every rank rank 0's optimizer state: its hyper-parameters, and per parameter what the
    optimizer keeps (Adam: the step count and both moments), even where a rank holds none yet.

    A rank that has never stepped has no state at all, so it cannot receive into tensors of the
    right shapes: send the state as an object (dist.broadcast_object_list) and load it.
    """
    # TODO(exercise 10): rank 0's state_dict, loaded on every rank.
    raise NotImplementedError("Exercise 10: broadcast_optimizer_state is not written yet, see exercises/10_hvd.md")


class DistributedOptimizer:
    """Wrap any torch optimizer so that step() first averages every gradient over the ranks.

    The gradients travel flattened, one buffer per dtype and one all-reduce per buffer, not one
    per parameter. Every rank must hold gradients for the same parameters, in the same order.
    To work on averaged gradients (clipping, say), call synchronize() first: the step that
    follows does not average again.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.synchronized = False

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Replace every gradient by its mean over the ranks: one all-reduce (dist.all_reduce) per dtype, of a
        buffer in that dtype, the dtypes in the order their first gradients come."""
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        # TODO(exercise 10): flatten the gradients of each dtype into one tensor, all-reduce it once,
        # and copy the mean back into each gradient.
        raise NotImplementedError(
            "Exercise 10: DistributedOptimizer.synchronize is not written yet, see exercises/10_hvd.md"
        )
        self.synchronized = True

    def step(self, closure=None):
        if not self.synchronized:
            self.synchronize()
        self.synchronized = False
        return self.optimizer.step(closure)


def train(config: ModelConfig, weight_decay: float = 0.01) -> dict:
    """Train the MLP with AdamW, data-parallel through the optimizer; return final figures.

    Batch i belongs to rank i % world_size, as in exercise 3.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.seed + rank)  # every rank draws its own weights: the broadcast makes them one
    train_set, test_set = split_dataset(*gen_dataset(config, rand_state=config.seed))
    model = MLP(config)
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=weight_decay))
    broadcast_parameters(model)
    broadcast_optimizer_state(optimizer)
    step, step_times = 0, []
    for i, x, y in batches(*train_set, config.batch_size, config.seed):
        if step == config.niters:
            break
        if i % world_size != rank:
            continue
        t0 = time.perf_counter()
        optimizer.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        step_times.append((time.perf_counter() - t0) * 1000)
        if rank == 0 and step % 100 == 0:
            print(f"step {step} | train_loss {loss.item():.4f} | test_loss {evaluate(model, test_set):.4f}")
        step += 1
    return {
        "train_loss": loss.item(),
        "test_loss": evaluate(model, test_set),
        "parameters_close": check_parameter_closeness(model),
        "step_ms": statistics.median(step_times),
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.set_defaults(learning_rate=0.001)
    args = parser.parse_args()
    check_batch_fits(parser, args.batch_size, len(split_dataset(range(args.train_size), range(args.train_size))[0][0]))
    report(launch(train, args.world_size, config_from(args), **launch_options(args))[0])

# ruff: noqa: F401, F821, F841, B007 - what a stub leaves unused or undefined until it is written
