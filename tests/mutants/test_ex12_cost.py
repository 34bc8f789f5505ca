"""The checks of exercise 12 catch a wrong formula of the cost model, each with a message that names it.

Instructors only: these need solutions/.
"""

import os
import re
import time

import pytest

from checks.test_ex12_cost import check_exposed, check_fit, check_largest_world, check_ring, check_speedup
from course.launch import WorldFailed
from course.layout import SOLUTIONS
from tests import warm
from tests.mutants import assert_caught, assert_refused, make_mutant
from tests.own_time import Watch

RING = "return 2 * (world_size - 1) * (alpha + n / (world_size * beta))"
SEARCH = "gains = [r for r in range(2, most + 1) if t_sync_of(r) / t_comp < r - 1]"

MUTANTS = {
    "the ring takes W - 1 steps": (
        RING,
        "return (world_size - 1) * (alpha + n / (world_size * beta))",
        check_ring,
        "a ring takes 2(W - 1) steps",
    ),
    "every ring step sends the whole tensor": (
        RING,
        "return 2 * (world_size - 1) * (alpha + n / beta)",
        check_ring,
        "each step sends one chunk, n / W bytes",
    ),
    "a bucket waits for its ready time and the link, added": (
        "end = max(at, end) + ring_allreduce_seconds(n, world_size, alpha, beta)",
        "end = at + end + ring_allreduce_seconds(n, world_size, alpha, beta)",
        check_exposed,
        "their maximum, not their sum",
    ),
    "a bucket starts when it is ready, whether the link is free or not": (
        "    end = 0.0\n    for at, n in zip(ready, sizes):\n"
        "        end = max(at, end) + ring_allreduce_seconds(n, world_size, alpha, beta)",
        "    end = 0.0\n    for at, n in zip(ready, sizes):\n"
        "        end = at + ring_allreduce_seconds(n, world_size, alpha, beta)",
        check_exposed,
        "also waits for the link",
    ),
    "buckets taken in the order of their ready times": (
        "for at, n in zip(ready, sizes):",
        "for at, n in sorted(zip(ready, sizes)):",
        check_exposed,
        "a bucket whose gradients are ready before the one ahead of it still waits",
    ),
    "communication that ends before the backward pass counts as exposed": (
        "return max(0.0, end - backward_end)",
        "return end - backward_end",
        check_exposed,
        "not a negative time",
    ),
    "the slope taken for beta": (
        "return float(alpha), float(1 / slope)",
        "return float(alpha), float(slope)",
        check_fit,
        "1 / beta, not beta",
    ),
    "a line through the first and last points": (
        "    slope = ((n - n.mean()) * (t - t.mean())).sum() / ((n - n.mean()) ** 2).sum()\n"
        "    alpha = t.mean() - slope * n.mean()",
        "    slope = (t[-1] - t[0]) / (n[-1] - n[0])\n    alpha = t[0] - slope * n[0]",
        check_fit,
        "the line through the first and last points",
    ),
    # alpha, the smallest time; beta from the largest message alone.
    "alpha and beta read off the ends": (
        "    alpha = t.mean() - slope * n.mean()\n    return float(alpha), float(1 / slope)",
        "    alpha = t.min()\n    return float(alpha), float(n[-1] / (t[-1] - alpha))",
        check_fit,
        "least-squares line",
    ),
    "one rank costs a step": (
        RING,
        "return 2 * max(world_size - 1, 1) * (alpha + n / (world_size * beta))",
        check_ring,
        "one rank sends nothing",
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
        check_largest_world,
        "T_sync(R) / T_comp < R - 1",
    ),
    # predict calls largest_world without most: its default is part of what it promises.
    "another default for most": (
        "most: int = 1024",
        "most: int = 1000",
        check_largest_world,
        "the default that predict relies on",
    ),
    "the search stops before most": (
        "for r in range(2, most + 1)",
        "for r in range(2, most)",
        check_largest_world,
        "the range goes up to most, included",
    ),
    "the condition taken with <=": (
        "if t_sync_of(r) / t_comp < r - 1]",
        "if t_sync_of(r) / t_comp <= r - 1]",
        check_largest_world,
        "the condition is strict",
    ),
    "the search starts at 3": (
        "for r in range(2, most + 1)",
        "for r in range(3, most + 1)",
        check_largest_world,
        "start at R = 2",
    ),
    "the search stops at the first R that does not gain": (
        SEARCH + "\n    return max(gains, default=1)",
        "r = 2\n    while r <= most and t_sync_of(r) / t_comp < r - 1:\n        r += 1\n    return r - 1",
        check_largest_world,
        "do not stop at the first that fails",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, "cost.py", *MUTANTS[mistake])


def test_exposed_is_judged_apart_from_the_ring(tmp_path):
    """exposed_seconds calls ring_allreduce_seconds: a wrong ring costs the ring's check, not exposed_seconds's."""
    folder = make_mutant(tmp_path / "mutant", "cost.py", RING, "return (world_size - 1) * (alpha + n / beta)")
    with pytest.raises(AssertionError, match="ring_allreduce_seconds"):
        check_ring(folder)
    check_exposed(folder)


def test_a_function_not_written_costs_its_own_check_only(tmp_path):
    folder = make_mutant(tmp_path / "mutant", "cost.py", RING, 'raise NotImplementedError("Exercise 12: ring")')
    with pytest.raises(WorldFailed):
        check_ring(folder)
    for check in (check_fit, check_exposed, check_speedup, check_largest_world):
        check(folder)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--world-size", "1"], "--world-size 2 or more"),
        (["--world-size", "0"], "'0' is not a whole number of at least 1"),
        (["--batch-size", "0"], "'0' is not a whole number"),
    ],
)
def test_bad_arguments_are_refused(args, words):
    assert_refused("cost.py", args, words)


# largest_world as a while loop whose r never grows: it goes round for ever, calling t_sync_of each time.
ENDLESS = (
    SEARCH + "\n    return max(gains, default=1)",
    "best, r = 1, 2\n    while r <= most:\n        if t_sync_of(r) / t_comp < r - 1:\n"
    "            best = r\n    return best",
)
LOOP_LIMIT = 5  # seconds of a world: a world of these checks, or of the script's measurements, takes under 2 s


def loop_lines(folder):
    """The lines of the endless loop in the mutant's cost.py: where a rank in it can be."""
    with open(os.path.join(folder, "cost.py")) as f:
        first = next(n for n, text in enumerate(f, 1) if "while r <= most" in text)
    return {first, first + 1, first + 2}


def test_an_endless_loop_costs_its_own_check_and_is_named_where_it_loops(tmp_path):
    """Issue 29: the grader reported the loop in largest_world where one stack caught the rank, in the
    check's own t_sync_of (test_ex12_cost.py:54 in sync_growing). It names largest_world's line."""
    folder = make_mutant(tmp_path / "mutant", "cost.py", *ENDLESS)
    with Watch() as watch:
        start = time.time()
        limit = {"COURSE_TIMEOUT": str(LOOP_LIMIT)}
        done = warm.grade("--ex", "12", impl=folder, cwd=tmp_path, env=limit, started=watch.follow)
        end = time.time()
    seconds = watch.own_between(start, end)  # the grade's own time, as its worlds' limits count
    failed = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("x ")]
    assert re.search(r"^ +12 +4/5 +16/20$", done.stdout, re.M) and len(failed) == 1, done.stdout + done.stderr
    where = re.search(r"Where each rank was: rank 0 runs at cost\.py:(\d+) in largest_world$", failed[0])
    assert failed[0].startswith(f"x test_largest_world: Timed out after {LOOP_LIMIT} s") and where, failed[0]
    assert "a loop that does not end" in failed[0] and int(where[1]) in loop_lines(folder), failed[0]
    assert seconds < LOOP_LIMIT + 15, f"the grade of exercise 12 took {seconds:.1f} s of its own time"


def test_the_script_stops_an_endless_loop_at_its_limit_and_names_where_it_loops(tmp_path):
    """Issue 29: `python cost.py` said "cost.py:149 in sync_of", a function the loop calls, and only
    asked for a longer --time-limit."""
    folder = make_mutant(tmp_path, "cost.py", *ENDLESS)
    with Watch() as watch:
        start = time.time()
        done = warm.run(["cost.py", "--time-limit", str(LOOP_LIMIT)], cwd=folder, started=watch.follow)
        end = time.time()
    seconds = watch.own_between(start, end)  # the script's own time, as its worlds' limits count
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and lines[0] == (
        f"Timed out after {LOOP_LIMIT} s: ranks [0] were still running (a loop that does not end, or a run that"
        " needs --time-limit SECONDS?). Where each rank was:"
    ), done.stderr
    where = re.fullmatch(r"  rank 0 runs at cost\.py:(\d+) in largest_world", lines[1])
    assert len(lines) == 2 and where and int(where[1]) in loop_lines(folder), done.stderr
    # Its measurements, then the prediction's world, stopped at its limit.
    assert seconds < 2 * LOOP_LIMIT + 5, f"python cost.py took {seconds:.1f} s of its own time"


def test_the_script_says_the_world_size_it_measured_on():
    """Issue 29: `python cost.py --world-size 3` printed the same lines as on 2 ranks."""
    done = warm.run(["cost.py", "--world-size", "3"], cwd=SOLUTIONS)
    assert done.returncode == 0 and "one step on 3 ranks, one all-reduce per parameter: predicted" in done.stdout, (
        done.stdout + done.stderr
    )
