"""Exercise 4: MyDP, data parallelism by hand."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from checks.contracts import check_contracts
from checks.helpers import (
    SMALL_PARAMETERS,
    check_equivalence,
    check_start_sync,
    drawn_batches,
    keyed,
    load,
    many,
    maybe,
    parallel_steps,
    reference_world,
    world,
)
from course.grading.points import said


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
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    return {
        "grads": grads,
        "argument_changed": sorted(n for n, (grad, copy) in received.items() if not torch.equal(grad, copy)),
        # What the hooks returned became .grad: equal to what they were given if they returned nothing.
        "returned_new": sorted(n for n, (_, copy) in received.items() if not torch.equal(grads[n], copy)),
    }


FROZEN = {
    "grads": keyed(maybe(torch.Tensor), ["0.weight", "0.bias", "1.weight", "1.bias"]),
    "argument_changed": many(str),
    "returned_new": many(str),
}


def check_frozen(folder):
    """A frozen parameter gets no gradient and no hook; the others' gradients are still averaged."""
    grads = [rank["grads"] for rank in world(frozen_step, 2, folder, expect=FROZEN)]
    assert grads[0]["0.weight"] is None, said(
        "a frozen parameter given a gradient or a hook",
        "a parameter with requires_grad=False should get no gradient and no hook",
    )
    assert torch.equal(grads[0]["1.weight"], grads[1]["1.weight"]), said(
        "the other gradients not averaged beside a frozen parameter",
        "the other parameters' gradients should still be averaged",
    )


def check_hook_leaves_its_argument(folder):
    """A tensor hook returns a new gradient; the one it was given may be read by others afterwards.

    Each rank's gradients differ here, so an average differs from what every rank was given."""
    results = world(frozen_step, 2, folder, expect=FROZEN)
    for rank, got in enumerate(results):
        assert not got["argument_changed"], said(
            "the hook changing its argument in place",
            f"rank {rank}: the hook changed the gradient it was given, in place ({', '.join(got['argument_changed'])}):"
            " a hook must leave its argument alone and return a new tensor",
        )
    assert any(got["returned_new"] for got in results), said(
        "the hook returning nothing new",
        "every rank's gradients are what the hook was given: the hook returned nothing new (a hook that returns"
        " None leaves the gradient as it was); it must return the average as a new tensor",
    )


def check_mydp_steps(folder, world_size, steps=3):
    """MyDP's steps equal one process's on the whole batch, and torch's DDP's from the same start."""
    given = drawn_batches(world_size, steps)  # both runs on the same rows
    results = check_equivalence(folder, "mydp", world_size, steps, given)
    expect = {"history": many(SMALL_PARAMETERS, steps)}
    theirs = reference_world(parallel_steps, world_size, None, "torch_ddp", expect=expect, per_rank=given.parts)
    for rank, (got, builtin) in enumerate(zip(results, theirs)):
        mine, builtin = got["history"][-1], builtin["history"][-1]
        gap = max((mine[k] - builtin[k]).abs().max().item() for k in mine)
        assert gap < 1e-5, (
            f"after {steps} steps from the same start, rank {rank}'s MyDP and torch's DDP are {gap:.3g} apart"
        )


@pytest.mark.points(4)
@pytest.mark.parametrize("world_size", [2, 3])
def test_start_sync(impl_dir, world_size):
    check_start_sync(impl_dir, world_size)


@pytest.mark.points(8)
@pytest.mark.parametrize("world_size", [2, 3])
def test_mydp_steps(impl_dir, world_size):
    check_mydp_steps(impl_dir, world_size)


@pytest.mark.points(3)
def test_frozen_parameters(impl_dir):
    check_frozen(impl_dir)


@pytest.mark.points(2)
def test_hook_leaves_its_argument(impl_dir):
    check_hook_leaves_its_argument(impl_dir)


@pytest.mark.points(1)
def test_contracts(impl_dir):
    """Every promise declared for the exercise's functions in checks/contracts.py: MyDP starts every rank
    from rank 0's parameters and buffers, frozen and non-persistent ones too."""
    check_contracts(impl_dir, 4)
