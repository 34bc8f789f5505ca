"""The checks of exercise 5 catch the classic mistakes of a ring all-reduce, which a check of final
numbers alone lets through.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
mistake and shows that the check for it fails, with a message that points at the mistake.
"""

import pytest

from checks.test_ex05_ring import check_ring
from tests.mutants import assert_caught, forbidden_or

MUTANTS = {
    "ring sends the whole tensor at every step": (
        "dist.py",
        "chunks = tensor.view(-1).tensor_split(world_size)",
        "chunks = [tensor.view(-1)] * world_size",
        lambda folder: check_ring(folder, 2),
        "send one chunk per step",
    ),
    "ring calls dist.all_reduce": (
        "dist.py",
        "    # Rank r now holds the complete sum",
        "    return dist.all_reduce(tensor)\n    # Rank r now holds the complete sum",
        lambda folder: check_ring(folder, 2),
        forbidden_or("collective", "no collective"),
    ),
    # Issue 47: torch's functional collectives reach no process group method that CommLog wraps; the ring sent nothing.
    "ring as torch's functional all-reduce": (
        "dist.py",
        "    chunks = tensor.view(-1).tensor_split(world_size)\n",
        "    funcol = __import__('torch.distributed._functional_collectives', fromlist=['all_reduce'])\n"
        "    tensor.copy_(funcol.all_reduce(tensor, 'sum', dist.group.WORLD))\n"
        "    return\n",
        lambda folder: check_ring(folder, 3),
        forbidden_or("collective", "the sum went another way"),
    ),
    # Issue 47: the same by torch's functional reduce-scatter and all-gather, which move a ring's bytes.
    "ring as torch's functional reduce-scatter and all-gather": (
        "dist.py",
        "    chunks = tensor.view(-1).tensor_split(world_size)\n",
        "    funcol = __import__('torch.distributed._functional_collectives', fromlist=['all_gather_tensor'])\n"
        "    flat = tensor.view(-1)\n"
        "    padded = torch.zeros(-(-flat.numel() // world_size) * world_size, dtype=tensor.dtype)\n"
        "    padded[: flat.numel()] = flat\n"
        "    mine = funcol.reduce_scatter_tensor(padded, 'sum', 0, dist.group.WORLD)\n"
        "    flat.copy_(funcol.wait_tensor(funcol.all_gather_tensor(mine, 0, dist.group.WORLD))[: flat.numel()])\n"
        "    return\n",
        lambda folder: check_ring(folder, 3),
        forbidden_or("collective", "the sum went another way"),
    ),
    "exchange never waits for its send": (
        "dist.py",
        "    for request in requests:\n        request.wait()\n",
        "    requests[1].wait()\n",
        lambda folder: check_ring(folder, 2),
        "never waited for",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])
