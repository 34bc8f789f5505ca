"""Exercise 3: built-in DistributedDataParallel, the rank's share of batches, and the closeness check."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from checks.contracts import assert_returns, check_contracts
from checks.helpers import (
    SMALL_PARAMETERS,
    alone,
    check_equivalence,
    check_start_sync,
    load,
    printed,
    small_config,
    world,
)
from course.grading.points import said


def train_in_world(folder, changes):
    """Probe: mlp.train on SMALL with changes; the figures it returned and what it printed."""
    mlp = load(folder).mlp
    result, out = printed(mlp.train, small_config(mlp, **changes))
    return {"state": result["state"], "parameters_close": result["parameters_close"], "printed": out}


TRAINED = {"state": SMALL_PARAMETERS, "parameters_close": object, "printed": str}


def check_ddp_steps(folder, world_size):
    """wrap_ddp's model starts every rank from rank 0's parameters and buffers, and its steps are one process's."""
    check_start_sync(folder, world_size, "ddp")
    check_equivalence(folder, "ddp", world_size)


def check_train_shares_batches(folder, world_size=2):
    """W ranks with batches of 8 take the same steps as one process with batches of 8 W. With 2 ranks,
    training on the batches i % W != r is training on i % W == r under another name: 3 tell them apart."""
    steps = {"niters": 6}  # within one pass over the 160 samples, for 2 and 3 ranks
    ranks = world(train_in_world, world_size, folder, {"batch_size": 8, **steps}, expect=TRAINED)
    alone_state = alone(train_in_world, folder, {"batch_size": 8 * world_size, **steps}, expect=TRAINED)["state"]
    for rank, got in enumerate(ranks):
        assert_returns("mlp.check_parameter_closeness", got["parameters_close"], rank, world_size)
    same = all(torch.equal(ranks[0]["state"][k], ranks[1]["state"][k]) for k in alone_state)
    assert same and ranks[0]["parameters_close"] is True and ranks[1]["parameters_close"] is True, said(
        "ranks ending with different parameters",
        "train should end with the same parameters on every rank: does every rank start from rank 0's parameters,"
        " and step with the same averaged gradients?",
    )
    for name, expected in alone_state.items():
        got = ranks[0]["state"][name]
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5), (
            f"after training on {world_size} ranks, {name} differs from one process on batches {world_size} times"
            " as large, though every rank ends with the same parameters: does rank r train on the batches i with"
            " i % world_size == r, and only those?"
        )


def closeness_verdicts(folder):
    """Probe: what check_parameter_closeness says when all ranks agree, then when the last rank does not."""
    mlp = load(folder).mlp
    verdicts = []
    for perturbed_rank in (-1, dist.get_world_size() - 1):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
        if dist.get_rank() == perturbed_rank:
            with torch.no_grad():
                model[2].weight[0, 0] += 1e-3
        verdicts.append(mlp.check_parameter_closeness(model))
    return verdicts


def check_closeness(folder, world_size):
    """check_parameter_closeness answers True on every rank when the ranks agree, False on every rank when one differs."""
    verdicts = world(closeness_verdicts, world_size, folder, expect=(object, object))
    for rank, verdict in enumerate(verdicts):
        for value in verdict:
            assert_returns("mlp.check_parameter_closeness", value, rank, world_size)
    same, differ = zip(*verdicts)
    assert list(same) == [True] * world_size, said(
        "check_parameter_closeness False though the ranks agree",
        f"check_parameter_closeness should return True on every rank when all ranks agree, got {list(same)}",
    )
    assert list(differ) == [False] * world_size, said(
        "check_parameter_closeness True though a rank differs",
        f"rank {world_size - 1} holds a different weight: check_parameter_closeness should return False on every rank, got {list(differ)}",
    )


def check_rank0_prints(folder):
    """Only rank 0 prints the step lines."""
    printed_by = [rank["printed"] for rank in world(train_in_world, 2, folder, {"niters": 1}, expect=TRAINED)]
    assert [out.count("step 0 |") for out in printed_by] == [1, 0], "only rank 0 should print the step lines"


@pytest.mark.points(5)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_steps(impl_dir, world_size):
    check_ddp_steps(impl_dir, world_size)


@pytest.mark.points(4)
@pytest.mark.parametrize("world_size", [2, 3])
def test_train_shares_batches(impl_dir, world_size):
    check_train_shares_batches(impl_dir, world_size)


@pytest.mark.points(2)
@pytest.mark.parametrize("world_size", [2, 3])
def test_closeness(impl_dir, world_size):
    check_closeness(impl_dir, world_size)


@pytest.mark.points(1)
def test_rank0_prints(impl_dir):
    check_rank0_prints(impl_dir)


@pytest.mark.points(2)
def test_contracts(impl_dir):
    """Every promise declared for the exercise's functions in checks/contracts.py: check_parameter_closeness returns a bool, compares within torch.allclose's tolerance, parameters of any dtype too, and answers in a world of one."""
    check_contracts(impl_dir, 3)
