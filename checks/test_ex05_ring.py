"""Exercise 5: ring all-reduce from point-to-point messages."""

import math

import pytest
import torch

from checks.comm_log import SUMMARY, CommLog
from checks.helpers import Given, drawn, load, many, world
from course.grading.points import said

# No world of these checks builds an optimizer: grading them alone need not import torch._dynamo
# (checks/conftest.py).
IMPORTS_DYNAMO = False

# Shapes from empty to long, shorter than the world and not divisible by it; floats and integers.
CASES = [
    ((1,), torch.float32),
    ((2,), torch.int64),
    ((3,), torch.float64),
    ((5,), torch.int32),
    ((0,), torch.float32),
    ((7, 9), torch.float32),
    ((1000,), torch.int64),
    ((4099,), torch.float32),
]


def rank_tensor(i, rank):
    """Rank rank's input of case i: drawn as the check runs where the grade counts (drawn())."""
    shape, dtype = CASES[i]
    return (torch.randn(shape, generator=drawn(10 * i + rank)) * 100).to(dtype)


def ring_in_world(folder, tensors):
    """Probe, on every rank: ring_all_reduce each case's tensor (this rank's own, given by the judge), and
    note what it sent to whom."""
    d = load(folder).dist
    out = []
    for tensor in tensors:
        with CommLog() as log:
            d.ring_all_reduce(tensor)
        out.append((tensor, log.summary()))
    return out


def check_ring(folder, world_size):
    """ring_all_reduce sums in place over the ranks with point-to-point messages only: one chunk per step to
    one neighbour, every message waited for."""
    # Each rank is given its own tensors only: no rank can know the sum without the others' messages.
    given = Given(
        lambda: [[rank_tensor(i, rank) for i in range(len(CASES))] for rank in range(world_size)],
        lambda tensors: [(own,) for own in tensors],
    )
    shape = many((torch.Tensor, SUMMARY), len(CASES))
    observed = world(ring_in_world, world_size, folder, expect=shape, observe=True, per_rank=given)
    results, tensors = observed.results, given.value
    sums = [sum(own[i] for own in tensors) for i in range(len(CASES))]
    for rank, per_case in enumerate(results):
        neighbours = {(rank + 1) % world_size, (rank - 1) % world_size} - {rank}
        for (shape, dtype), expected, (got, log) in zip(CASES, sums, per_case):
            what = f"with {world_size} ranks, a {dtype} tensor of shape {list(shape)}"
            assert not log["collectives"], said(
                "a collective in the ring",
                f"{what}: ring_all_reduce called {log['collectives'][0]}: use only point-to-point messages"
                " (dist.isend, dist.irecv), no collective",
            )
            assert got.dtype == dtype and got.shape == expected.shape, said(
                "the sum not in place", f"{what}: ring_all_reduce should sum in place"
            )
            same = (
                torch.equal(got, expected.to(dtype))
                if not dtype.is_floating_point
                else torch.allclose(got, expected, rtol=1e-5, atol=1e-3)
            )
            assert same, said(
                "not the sum over the ranks",
                f"{what}: rank {rank} does not hold the sum over ranks that dist.all_reduce gives",
            )
            ring_bytes = 2 * (world_size - 1) * math.ceil(got.numel() / world_size) * got.element_size()
            assert log["sent_bytes"] <= ring_bytes, said(
                "more than one chunk sent per step",
                f"{what}: rank {rank} sent {log['sent_bytes']} bytes, a ring sends at most {ring_bytes}"
                f" (2(W-1) chunks of 1/W of the tensor): send one chunk per step, not the whole tensor",
            )
            assert len(log["send_peers"]) <= 1 and set(log["send_peers"]) <= neighbours, said(
                "sends to other ranks than one neighbour",
                f"{what}: rank {rank} sent to ranks {log['send_peers']}: on a ring it sends to one neighbour only",
            )
            assert len(log["receive_peers"]) <= 1 and set(log["receive_peers"]) <= neighbours, said(
                "receives from other ranks than one neighbour",
                f"{what}: rank {rank} received from ranks {log['receive_peers']}: on a ring it receives from one"
                " neighbour only",
            )
            assert not log["not_waited"], said(
                "messages never waited for",
                f"{what}: rank {rank} returned before waiting for all its sends and receives",
            )
    for i, (shape, dtype) in enumerate(CASES):
        # Both directions: at most a ring's bytes per rank (above), and at least what any all-reduce of messages
        # must send, over the world: each element travels to the others from W - 1 ranks and back to W - 1.
        sent = sum(per_case[i][1]["sent_bytes"] for per_case in results)
        least = 2 * (world_size - 1) * math.prod(shape) * dtype.itemsize
        assert sent >= least, said(
            "a sum that no message carried",
            f"with {world_size} ranks, a {dtype} tensor of shape {list(shape)}: the ranks sent {sent} bytes in all by"
            f" point-to-point messages, where any all-reduce by messages sends at least {least} (2(W-1) times the"
            " tensor): the sum went another way (a collective, torch's functional collectives); use dist.isend and"
            " dist.irecv",
        )
    # The same bound on what the kernel counted (where grades are made: a world's network is its own), which no
    # code in the workers can write: a sum the ranks computed without exchanging anything (their inputs made
    # the checks' way) and a log written to match fail it.
    least = sum(2 * (world_size - 1) * math.prod(shape) * dtype.itemsize for shape, dtype in CASES)
    carried = observed.loopback_bytes
    assert carried is None or carried >= least, said(
        "a sum that no message carried",
        f"with {world_size} ranks, the world's network carried {carried} bytes in all during the ring's cases, as"
        f" the kernel counted them, where any all-reduce by messages sends at least {least} (2(W-1) times each"
        " tensor): the ranks did not exchange their tensors; use dist.isend and dist.irecv",
    )


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.points(6)), 3, 4])
@pytest.mark.points(7)
def test_ring(impl_dir, world_size):
    """A ring of 1 rank sends nothing and keeps the tensor: a function that does nothing would pass
    it alone, so it is part of the case of 2 ranks."""
    if world_size == 2:
        check_ring(impl_dir, 1)
    check_ring(impl_dir, world_size)
