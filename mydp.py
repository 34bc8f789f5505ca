# Your copy of the exercise code: fill in every TODO, then `make grade` checks it.
"""Exercises 4, 6 and 7: data parallelism by hand, in a wrapper as easy to use as the built-in DDP.

    python mydp.py --world-size 2
    python mydp.py --world-size 2 --compare    # also train with built-in DDP and compare
    python mydp.py --world-size 2 --bucket-cap-mb 1   # exercises 6-7: OverlappedDP, 1 MiB buckets
    python mydp.py --world-size 2 --bucket-cap-mb 1 --timeline step.svg   # one step of each, drawn

Handouts: exercises/04_mydp.md, exercises/06_overlap.md, exercises/07_accumulation.md.
"""

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable

from course import timeline
from course.launch import launch, launch_options
from mlp import MLP, config_from, gen_dataset, make_parser, report, train, wrap_ddp


class MyDP(nn.Module):
    """Wrap a model so that every rank starts from rank 0's weights and steps with averaged gradients."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model
        # TODO(exercise 4): 1. broadcast rank 0's parameters and buffers (dist.broadcast);
        # 2. register a hook (Tensor.register_hook) on every parameter that requires a gradient;
        #    the hook returns the gradient all-reduced (dist.all_reduce) and averaged over ranks.
        raise NotImplementedError("Exercise 4: MyDP.__init__ is not written yet, see exercises/04_mydp.md")

    @staticmethod
    def _average_across_ranks(grad: torch.Tensor) -> torch.Tensor:
        """The mean of this gradient over all ranks (the loss is a mean over each rank's batch)."""
        # TODO(exercise 4): return a new tensor; a hook must not modify its argument.
        raise NotImplementedError("Exercise 4: MyDP._average_across_ranks is not written yet, see exercises/04_mydp.md")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def bucket_parameters(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters into buckets of at most cap_bytes of gradients; returns a list of lists.

    Backward produces gradients roughly in reverse order of registration (the last layer's
    first), so walk the parameters from last to first. A bucket takes parameters until the next
    one would make it larger than cap_bytes; that one starts a new bucket. A parameter larger
    than cap_bytes gets a bucket of its own, so cap_bytes=0 means one bucket per parameter.
    """
    # TODO(exercise 6): the buckets, as lists of parameters (exercises/06_overlap.md has hints).
    raise NotImplementedError("Exercise 6: bucket_parameters is not written yet, see exercises/06_overlap.md")


class Bucket:
    """Parameters whose gradients travel together in one all-reduce, and that all-reduce's state."""

    def __init__(self, params):
        self.params = params
        self.ready = 0  # how many of them have their gradient in this backward pass
        # Their gradients, flat, for the all-reduce: made once, since a fresh tensor of many MiB
        # at every step costs the operating system's time to hand out its pages again.
        self.buffer = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.work = None  # the handle that dist.all_reduce(..., async_op=True) returned


class OverlappedDP(nn.Module):
    """MyDP that communicates while the backward pass computes: exercises 6 and 7.

    Gradients travel in buckets of about bucket_cap_mb MiB. As soon as the backward pass has
    produced every gradient of a bucket, that bucket's all-reduce starts in the background while
    autograd computes the rest. When the backward pass ends, a callback waits for every
    all-reduce and writes the averages into .grad, so optimizer.step() sees averaged gradients
    as with MyDP. bucket_cap_mb=0 all-reduces each parameter on its own.

    What every rank must keep, as with torch's DDP: the same model, its parameters in the same
    order; every trainable parameter used in every synchronised forward pass (an unused one never
    completes its bucket: DDP's find_unused_parameters is not supported); and no_sync(), or
    require_backward_grad_sync = False, for the same backward passes.
    """

    def __init__(self, model: nn.Module, bucket_cap_mb: float = 25) -> None:
        super().__init__()
        self.module = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = [Bucket(group) for group in bucket_parameters(params, int(bucket_cap_mb * 2**20))]
        self.launched = 0  # buckets whose all-reduce has started in this backward pass
        self.finish_queued = False
        # torch's DDP's name for it, so that training scripts that set it between micro-batches
        # work unchanged; no_sync() turns it off (exercise 7).
        self.require_backward_grad_sync = True
        # TODO(exercise 6): 1. start from rank 0's parameters and buffers, as MyDP does;
        # 2. have each parameter of each bucket call self._gradient_ready(bucket, param) once its
        #    gradient is complete.
        raise NotImplementedError("Exercise 6: OverlappedDP.__init__ is not written yet, see exercises/06_overlap.md")

    def _gradient_ready(self, bucket: Bucket, param: nn.Parameter) -> None:
        """Autograd calls this once param.grad holds its gradient, accumulated, for this pass."""
        if not self.require_backward_grad_sync:
            return  # inside no_sync(): the gradient stays in param.grad, on this rank only
        # TODO(exercise 6): 1. make sure self.finish_gradient_synchronization runs once this
        #    backward pass ends; 2. count the bucket's ready gradients; 3. launch (self._launch), in
        #    bucket order, every complete bucket: every rank must start them in the same order.
        raise NotImplementedError(
            "Exercise 6: OverlappedDP._gradient_ready is not written yet, see exercises/06_overlap.md"
        )

    def _launch(self, bucket: Bucket) -> None:
        """Start the all-reduce of a bucket's averaged gradients in the background."""
        # TODO(exercise 6): start the all-reduce of the bucket's gradients, averaged, through
        # bucket.buffer, without waiting for it; keep its handle in bucket.work.
        raise NotImplementedError("Exercise 6: OverlappedDP._launch is not written yet, see exercises/06_overlap.md")

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce and copy the averages into .grad; reset for the next pass."""
        # TODO(exercise 6): wait for each bucket's all-reduce, write the averages into .grad, and
        # reset the counts for the next backward pass.
        raise NotImplementedError(
            "Exercise 6: OverlappedDP.finish_gradient_synchronization is not written yet, see exercises/06_overlap.md"
        )

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside `with model.no_sync():` backward passes only accumulate gradients, locally.

        On leaving the block, synchronisation is as it was before it, as with torch's DDP: a
        no_sync() block inside another leaves the outer one still unsynchronised.
        """
        # TODO(exercise 7): turn self.require_backward_grad_sync off for the block, and give it back
        # its previous value after the block, even when the block raises.
        raise NotImplementedError(
            "Exercise 7: OverlappedDP.no_sync is not written yet, see exercises/07_accumulation.md"
        )

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def accumulation_step(
    model: OverlappedDP, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, micro_batches: int
) -> float:
    """One optimizer step on the batch (x, y), computed in micro_batches equal pieces; returns its loss.

    Each piece's loss is divided by micro_batches, so the gradients that accumulate in .grad add
    up to the gradient of the whole batch's mean loss. Every piece but the last runs inside
    model.no_sync(); the last backward pass averages the accumulated gradients across ranks.
    """
    # TODO(exercise 7): one step, every micro-batch but the last inside model.no_sync().
    raise NotImplementedError("Exercise 7: accumulation_step is not written yet, see exercises/07_accumulation.md")


def largest_difference(a, b):
    """The largest absolute difference between two state dicts with the same keys."""
    return max((a[k] - b[k]).abs().max().item() for k in a)


def train_both(config, check):
    """Train with MyDP, then with built-in DDP from the same start; return both results."""
    mine = train(config, check, wrap=MyDP)
    builtin = train(config, check, wrap=wrap_ddp)
    return mine, builtin


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--compare", action="store_true", help="also train with built-in DDP and compare")
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=None, help="train with OverlappedDP, buckets of this many MiB"
    )
    parser.add_argument(
        "--timeline", metavar="FILE.svg", help="draw one step of MyDP and of OverlappedDP on every rank, and stop"
    )
    args = parser.parse_args()
    config = config_from(args)
    if args.timeline:
        cap = 1 if args.bucket_cap_mb is None else args.bucket_cap_mb
        wraps = {"MyDP": MyDP, f"OverlappedDP, buckets of {cap:g} MiB": partial(OverlappedDP, bucket_cap_mb=cap)}
        x, y = (t[: config.batch_size] for t in gen_dataset(config, rand_state=config.seed))
        steps = launch(
            timeline.record_steps, args.world_size, partial(MLP, config), wraps, x, y, **launch_options(args)
        )
        timeline.write(args.timeline, timeline.by_wrapper(steps), f"one step on {args.world_size} ranks")
        print(f"wrote {args.timeline}")
    elif args.compare:
        mine, builtin = launch(train_both, args.world_size, config, args.check, **launch_options(args))[0]
        report(mine)
        gap = largest_difference(mine["state"], builtin["state"])
        print(f"largest parameter difference between MyDP and built-in DDP: {gap:.3g}")
    else:
        wrap = MyDP if args.bucket_cap_mb is None else partial(OverlappedDP, bucket_cap_mb=args.bucket_cap_mb)
        report(launch(train, args.world_size, config, args.check, wrap, **launch_options(args))[0])

# ruff: noqa: F401, F821, F841, B007 - what a stub leaves unused or undefined until it is written
