# Your copy of the exercise code: fill in every TODO, then `make grade` checks it.
"""Exercises 1 and 3: train a toy MLP on one process, then data-parallel with built-in DDP.

    python mlp.py                    # exercise 1: one process
    python mlp.py --world-size 2     # exercise 3: two workers, DistributedDataParallel

Handouts: exercises/01_mlp.md and exercises/03_ddp.md.
"""

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from course.device import amp_dtype, current_device, ddp_device_ids, synchronize
from course.flags import Parser, whole
from course.launch import add_launch_arguments, launch, launch_options


@dataclass
class ModelConfig:
    n_layers: int = 4
    d_in: int = 1024
    n_classes: int = 32
    d_hidden: int = 256
    batch_size: int = 64
    train_size: int = 10000
    niters: int = 1000
    lr: float = 0.1
    seed: int = 0
    amp: bool = False  # mixed precision: forward and backward matrix products in 16-bit floats


def gen_dataset(config, rand_state):
    """A learnable classification task: each class is a cloud of points around its own centre.

    Returns (X float32 [train_size, d_in], Y int64 [train_size]); the same rand_state gives the
    same data on every rank, so no rank has to send data to another.
    """
    g = torch.Generator().manual_seed(rand_state)
    centres = torch.randn(config.n_classes, config.d_in, generator=g) * 0.15
    Y = torch.randint(0, config.n_classes, (config.train_size,), generator=g)
    X = centres[Y] + torch.randn(config.train_size, config.d_in, generator=g)
    return X, Y


def split_dataset(X, Y, train_fraction=0.9):
    """The first 90% of the rows to train on, the last 10% held out to measure test loss."""
    n_train = int(len(X) * train_fraction)
    return (X[:n_train], Y[:n_train]), (X[n_train:], Y[n_train:])


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # TODO(exercise 1): n_layers bias-free nn.Linear layers in an nn.ModuleList named
        # self.layers: d_in -> d_hidden -> ... -> d_hidden -> n_classes.
        raise NotImplementedError("Exercise 1: MLP.__init__ is not written yet, see exercises/01_mlp.md")

    def forward(
        self, data: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (logits, loss): tanh between layers, none after the last; loss only with targets."""
        # TODO(exercise 1): run data through the layers.
        raise NotImplementedError("Exercise 1: MLP.forward is not written yet, see exercises/01_mlp.md")
        loss = F.cross_entropy(logits, targets) if targets is not None else None
        return logits, loss


@torch.no_grad()
def evaluate(
    model: nn.Module, dataset: tuple[torch.Tensor, torch.Tensor], batch_size: int = 50, max_batches: int | None = None
) -> float:
    """Mean loss of model over dataset = (X, Y), in batches; the model is left in training mode."""
    # TODO(exercise 1): switch to eval mode, average the loss over the batches, switch back.
    raise NotImplementedError("Exercise 1: evaluate is not written yet, see exercises/01_mlp.md")


def batches(X, Y, batch_size, seed):
    """Yield (index, x, y) for every batch, for ever: a new shuffle each epoch, the same on all ranks."""
    index, epoch = 0, 0
    while True:
        order = torch.randperm(len(X), generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, len(X) - batch_size + 1, batch_size):
            rows = order[start : start + batch_size]
            yield index, X[rows], Y[rows]
            index += 1
        epoch += 1


def wrap_ddp(model: nn.Module) -> DDP:
    """Exercise 3: return the model wrapped in PyTorch's DistributedDataParallel."""
    # TODO(exercise 3): one line. DDP broadcasts rank 0's weights and averages the gradients.
    raise NotImplementedError("Exercise 3: wrap_ddp is not written yet, see exercises/03_ddp.md")


def check_parameter_closeness(model: nn.Module) -> bool:
    """True on every rank when every rank holds the same parameters (torch.allclose), of any dtype.

    Rank 0 collects the parameters of all ranks with dist.gather, compares them, and sends its
    verdict to the others with dist.broadcast. With no process group there is nothing to compare.
    """
    if not dist.is_initialized():
        return True
    # TODO(exercise 3): gather to rank 0, compare, broadcast the verdict.
    raise NotImplementedError("Exercise 3: check_parameter_closeness is not written yet, see exercises/03_ddp.md")


def require_same_parameters(model: nn.Module, step: int) -> None:
    """--check: stop before `step` if the ranks' parameters differ, and say what that points to."""
    if check_parameter_closeness(model):
        return
    if step == 0:
        raise RuntimeError(
            "ranks hold different parameters before the first step: does the wrapper start every rank from rank 0's parameters?"
        )
    raise RuntimeError(
        f"ranks hold different parameters after step {step - 1}: does every rank step with the same averaged gradients?"
    )


def train(config: ModelConfig, check: bool = False, wrap: Callable[[nn.Module], nn.Module] = wrap_ddp) -> dict:
    """Train an MLP; in a process group, data-parallel with wrap(model). Returns final figures.

    Every rank builds the same data. Batch i belongs to rank i % world_size, so one step of the
    world covers world_size batches. Only rank 0 prints.
    """
    distributed = dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = current_device()
    # Each rank draws its own initial weights, as separate machines would: only the wrapper's
    # broadcast makes them start alike, so the scripts show a missing broadcast. The data comes
    # from its own generator, the same on every rank.
    torch.manual_seed(config.seed + rank)
    train_set, test_set = split_dataset(*(t.to(device) for t in gen_dataset(config, rand_state=config.seed)))
    model = MLP(config).to(device)
    if distributed:
        model = wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    # float16 gradients can round to zero: the scaler multiplies the loss first (bfloat16 needs none).
    precision = amp_dtype(device) if config.amp else None
    scaler = torch.amp.GradScaler(device.type, enabled=precision == torch.float16)
    step_times = []

    step = 0
    for i, x, y in batches(*train_set, config.batch_size, config.seed):
        if step == config.niters:
            break
        if distributed:
            # TODO(exercise 3): skip the batches that belong to the other ranks.
            raise NotImplementedError("Exercise 3: train is not written yet, see exercises/03_ddp.md")
        if check:
            require_same_parameters(model, step)
        synchronize(device)  # a GPU runs queued work after the call returns: time the work, not the queueing
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=precision, enabled=config.amp):
            _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        synchronize(device)
        step_ms = (time.perf_counter() - t0) * 1000
        step_times.append(step_ms)
        if rank == 0 and step % 100 == 0:
            test_loss = evaluate(model, test_set, max_batches=20)
            print(f"step {step} | train_loss {loss.item():.4f} | test_loss {test_loss:.4f} | step time {step_ms:.2f}ms")
        step += 1

    closeness = check_parameter_closeness(model)
    plain = model.module if distributed else model
    return {
        "train_loss": loss.item(),
        "test_loss": evaluate(model, test_set),
        "parameters_close": closeness,
        "step_ms": statistics.median(step_times),  # the median: the first steps also set things up
        "state": {k: v.detach().clone() for k, v in plain.state_dict().items()},
    }


def make_parser(description=__doc__):
    p = Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-layers", type=whole(1), default=ModelConfig.n_layers)
    p.add_argument("--dim-in", type=whole(1), default=ModelConfig.d_in)
    p.add_argument("--n-classes", type=whole(1), default=ModelConfig.n_classes)
    p.add_argument("--dim-hidden", type=whole(1), default=ModelConfig.d_hidden)
    p.add_argument("--train-size", type=whole(2), default=ModelConfig.train_size)
    p.add_argument("--batch-size", type=whole(1), default=ModelConfig.batch_size)
    p.add_argument("--learning-rate", type=float, default=ModelConfig.lr)
    p.add_argument("--niters", type=whole(1), default=ModelConfig.niters)
    p.add_argument("--seed", type=int, default=ModelConfig.seed)
    p.add_argument("--world-size", type=whole(1), default=1, help="number of worker processes")
    p.add_argument(
        "--check", action="store_true", help="check after every step that all ranks hold the same parameters"
    )
    p.add_argument(
        "--amp", action="store_true", help="mixed precision: bfloat16 (float16 on older GPUs) in forward and backward"
    )
    add_launch_arguments(p)
    return p


def config_from(args):
    return ModelConfig(
        n_layers=args.n_layers,
        d_in=args.dim_in,
        n_classes=args.n_classes,
        d_hidden=args.dim_hidden,
        batch_size=args.batch_size,
        train_size=args.train_size,
        niters=args.niters,
        lr=args.learning_rate,
        seed=args.seed,
        amp=args.amp,
    )


def report(result):
    print(
        f"final | train_loss {result['train_loss']:.4f} | test_loss {result['test_loss']:.4f}"
        f" | parameters close across ranks: {result['parameters_close']} | median step time {result['step_ms']:.2f}ms"
    )


if __name__ == "__main__":
    args = make_parser().parse_args()
    config = config_from(args)
    print(asdict(config) | {"world_size": args.world_size})
    # A world of one trains right here, without a process group: exercise 1 needs no DDP.
    report(launch(train, args.world_size, config, args.check, single_process=True, **launch_options(args))[0])

# ruff: noqa: F401, F821, F841, B007 - what a stub leaves unused or undefined until it is written
