"""Exercise 4: MyDP, data parallelism by hand."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from course import impl
from tests.helpers import check_equivalence, small_config, world


def start_state(folder):
    """Ranks build different weights and buffers; MyDP must hand every rank rank 0's."""
    mydp = impl.load(folder).mydp
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    model[1].running_mean.fill_(float(rank))
    wrapped = mydp.MyDP(model)
    assert wrapped.module is model, "MyDP should keep the wrapped model as .module"
    return {k: v.clone() for k, v in model.state_dict().items()}


def check_start_sync(folder, world_size):
    states = world(start_state, world_size, folder)
    torch.manual_seed(0)
    expected = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).state_dict()
    for rank, state in enumerate(states):
        for name, value in expected.items():
            assert torch.equal(state[name], value), f"after MyDP(model), rank {rank}'s {name} is not rank 0's: broadcast parameters and buffers from rank 0"


def frozen_step(folder):
    mydp = impl.load(folder).mydp
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].weight.requires_grad_(False)
    wrapped = mydp.MyDP(model)
    x = torch.full((2, 3), float(rank + 1))
    wrapped(x).sum().backward()
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def check_frozen(folder):
    grads = world(frozen_step, 2, folder)
    assert grads[0]["0.weight"] is None, "a parameter with requires_grad=False should get no gradient and no hook"
    assert torch.equal(grads[0]["1.weight"], grads[1]["1.weight"]), "the other parameters' gradients should still be averaged"


def compare_with_ddp(folder):
    ex = impl.load(folder)
    return ex.mydp.train_both(small_config(ex.mlp), False)


def check_matches_ddp(folder):
    mine, builtin = world(compare_with_ddp, 2, folder, ddp=True)[0]
    gap = impl.load(folder).mydp.largest_difference(mine["state"], builtin["state"])
    assert gap < 1e-5, f"MyDP and built-in DDP trained from the same start end {gap:.3g} apart"


@pytest.mark.parametrize("world_size", [2, 3])
def test_start_sync(impl_dir, world_size):
    check_start_sync(impl_dir, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_mydp_steps(impl_dir, world_size):
    check_equivalence(impl_dir, "mydp", world_size)


def test_frozen_parameters(impl_dir):
    check_frozen(impl_dir)


def test_matches_ddp(impl_dir):
    check_matches_ddp(impl_dir)
