"""Exercise 4: MyDP, data parallelism by hand."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.helpers import check_equivalence, load, model_with_buffers, small_config, world


def start_state(folder):
    """Probe: ranks build different weights and buffers; MyDP must hand every rank rank 0's."""
    model = model_with_buffers(dist.get_rank())
    wrapped = load(folder).mydp.MyDP(model)
    return {"kept": wrapped.module is model, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def check_start_sync(folder, world_size):
    states = world(start_state, world_size, folder)
    expected = model_with_buffers(0).state_dict()
    for rank, got in enumerate(states):
        assert got["kept"] is True, "MyDP should keep the wrapped model as .module"
        state = got["state"]
        for name, value in expected.items():
            assert torch.equal(state[name], value), (
                f"after MyDP(model), rank {rank}'s {name} is not rank 0's: broadcast parameters and buffers from rank 0"
            )


def frozen_step(folder):
    """Probe: one backward pass with a frozen weight; the gradients, and the gradients as MyDP's hooks
    received them (the test's own hooks run first and keep them) against copies taken then."""
    mydp = load(folder).mydp
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].weight.requires_grad_(False)
    received = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda grad, name=name: received.setdefault(name, (grad, grad.clone())) and None)
    wrapped = mydp.MyDP(model)
    x = torch.full((2, 3), float(rank + 1))
    wrapped(x).sum().backward()
    return {
        "grads": {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()},
        "argument_changed": sorted(n for n, (grad, copy) in received.items() if not torch.equal(grad, copy)),
    }


def check_frozen(folder):
    grads = [rank["grads"] for rank in world(frozen_step, 2, folder)]
    assert grads[0]["0.weight"] is None, "a parameter with requires_grad=False should get no gradient and no hook"
    assert torch.equal(grads[0]["1.weight"], grads[1]["1.weight"]), (
        "the other parameters' gradients should still be averaged"
    )


def check_hook_leaves_its_argument(folder):
    """A tensor hook returns a new gradient; the one it was given may be read by others afterwards."""
    for rank, got in enumerate(world(frozen_step, 2, folder)):
        assert not got["argument_changed"], (
            f"rank {rank}: the hook changed the gradient it was given, in place ({', '.join(got['argument_changed'])}):"
            " a hook must leave its argument alone and return a new tensor"
        )


def compare_with_ddp(folder):
    """Probe: train with MyDP, then with built-in DDP from the same start; both final states."""
    ex = load(folder)
    mine, builtin = ex.mydp.train_both(small_config(ex.mlp), False)
    return mine["state"], builtin["state"]


def check_matches_ddp(folder):
    mine, builtin = world(compare_with_ddp, 2, folder)[0]
    assert mine.keys() == builtin.keys(), (
        f"MyDP's model has parameters {sorted(mine)}, built-in DDP's {sorted(builtin)}"
    )
    gap = max((mine[k] - builtin[k]).abs().max().item() for k in mine)
    assert gap < 1e-5, f"MyDP and built-in DDP trained from the same start end {gap:.3g} apart"


@pytest.mark.parametrize("world_size", [2, 3])
def test_start_sync(impl_dir, world_size):
    check_start_sync(impl_dir, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_mydp_steps(impl_dir, world_size):
    check_equivalence(impl_dir, "mydp", world_size)


def test_frozen_parameters(impl_dir):
    check_frozen(impl_dir)


def test_hook_leaves_its_argument(impl_dir):
    check_hook_leaves_its_argument(impl_dir)


def test_matches_ddp(impl_dir):
    check_matches_ddp(impl_dir)
