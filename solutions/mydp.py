"""Exercise 4: data parallelism by hand, in a wrapper as easy to use as the built-in DDP.

    python mydp.py --world-size 2
    python mydp.py --world-size 2 --compare    # also train with built-in DDP and compare

Handout: exercises/04_mydp.md.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from course.launch import launch
from mlp import config_from, make_parser, report, train, wrap_ddp


class MyDP(nn.Module):
    """Wrap a model so that every rank starts from rank 0's weights and steps with averaged gradients."""

    def __init__(self, model):
        super().__init__()
        self.module = model
        # TODO(exercise 4): 1. broadcast rank 0's parameters and buffers (dist.broadcast);
        # 2. register a hook (Tensor.register_hook) on every parameter that requires a gradient;
        #    the hook returns the gradient all-reduced (dist.all_reduce) and averaged over ranks.
        ### BEGIN SOLUTION
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(tensor, src=0)
        for param in model.parameters():
            if param.requires_grad:
                param.register_hook(self._average_across_ranks)
        ### END SOLUTION

    @staticmethod
    def _average_across_ranks(grad):
        """The mean of this gradient over all ranks (the loss is a mean over each rank's batch)."""
        # TODO(exercise 4): return a new tensor; a hook must not modify its argument.
        ### BEGIN SOLUTION
        mean = grad / dist.get_world_size()
        dist.all_reduce(mean, op=dist.ReduceOp.SUM)
        return mean
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


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
    args = parser.parse_args()
    config = config_from(args)
    if args.compare:
        mine, builtin = launch(train_both, args.world_size, config, args.check, port=args.port)[0]
        report(mine)
        gap = largest_difference(mine["state"], builtin["state"])
        print(f"largest parameter difference between MyDP and built-in DDP: {gap:.3g}")
    else:
        report(launch(train, args.world_size, config, args.check, MyDP, port=args.port)[0])
