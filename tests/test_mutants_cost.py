"""The checks of exercise 12 catch a wrong formula of the cost model, each with a message that names it.

Instructors only: these need solutions/.
"""

import pytest

from tests.mutants import assert_caught
from tests.test_ex12_cost import check_exposed, check_fit, check_ring, check_speedup

MUTANTS = {
    "the ring takes W - 1 steps": (
        "return 2 * (world_size - 1) * (alpha + n / (world_size * beta))",
        "return (world_size - 1) * (alpha + n / (world_size * beta))",
        check_ring,
        "a ring takes 2(W - 1) steps",
    ),
    "every ring step sends the whole tensor": (
        "return 2 * (world_size - 1) * (alpha + n / (world_size * beta))",
        "return 2 * (world_size - 1) * (alpha + n / beta)",
        check_ring,
        "each step sends one chunk, n / W bytes",
    ),
    "a bucket waits for its ready time and the link, added": (
        "end = max(at, end) + ring_allreduce_seconds(n, world_size, alpha, beta)",
        "end = at + end + ring_allreduce_seconds(n, world_size, alpha, beta)",
        check_exposed,
        "the maximum, not the sum",
    ),
    "communication that ends before the backward pass counts as exposed": (
        "return max(0.0, end - backward_end)",
        "return end - backward_end",
        check_exposed,
        "only what ends after the backward pass is exposed",
    ),
    "the slope taken for beta": (
        "return float(alpha), float(1 / slope)",
        "return float(alpha), float(slope)",
        check_fit,
        "its slope is 1 / beta",
    ),
    "the speed-up without the ranks' share of the epoch": (
        "return world_size * t_comp / (t_comp + t_sync)",
        "return t_comp / (t_comp + t_sync)",
        check_speedup,
        "N / (R B) steps of t_comp + t_sync",
    ),
    "the blog's condition against R, not R - 1": (
        "if t_sync_of(r) / t_comp < r - 1]",
        "if t_sync_of(r) / t_comp < r]",
        check_speedup,
        "T_sync(R) / T_comp < R - 1",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, "cost.py", *MUTANTS[mistake])
