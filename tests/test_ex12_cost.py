"""Exercise 12: the cost model, checked on synthetic measurements whose alpha, beta and T_comp are known,
so that no grade depends on this machine's noise."""

import math

import torch

from tests.helpers import alone, load

# No world of these checks builds an optimizer (tests/conftest.py).
BUILDS_OPTIMIZERS = False

ALPHA, BETA = 50e-6, 2e9  # 50 us and 2 GB/s: a loopback link of the order this machine has
SIZES = [4e3 * 4**k for k in range(8)]  # 4 kB to 65 MB
# The expected values are worked out by hand (exercises/12_cost.md has the formulas), so that this
# file, which students have, holds no solution. (n bytes, W ranks): seconds.
RINGS = {(1e6, 1): 0.0, (1e6, 2): 600e-6, (3e6, 3): 2.2e-3, (64e6, 4): 0.0483, (1e3, 8): 700.875e-6}
# Buckets on 2 ranks: (ready times, bytes, end of the backward pass) and the exposed seconds.
# An idle link between buckets; a queue; everything done before the backward pass ends.
SCHEDULES = [
    (([0.001, 0.004, 0.009], [1e6, 1e6, 1e6], 0.0092), 0.0004),
    (([0.000, 0.000, 0.001], [4e6, 4e6, 4e6], 0.002), 0.0043),
    (([0.000, 0.005], [1e3, 1e3], 0.020), 0.0),
]
T_COMP = 0.010
# (t_sync, W): speed-up, with T_COMP.
SPEEDUPS = {(0.0, 1): 1.0, (0.005, 2): 4 / 3, (0.030, 4): 1.0}


def sync_growing(ranks):
    """T_sync growing faster than the ranks: 0.3 sqrt(R - 1) < 1 up to R = 12."""
    return 0.003 * (ranks - 1) ** 1.5


LARGEST = [12, 1]  # for sync_growing, and for a T_sync of 1 s (100 T_COMP) up to 64 ranks


def answers(folder):
    """Probe: the student's functions on the synthetic cases."""
    cost = load(folder).cost
    noise = torch.Generator().manual_seed(0)
    seconds = [ALPHA + n / BETA + float(torch.randn(1, generator=noise)) * 1e-7 for n in SIZES]
    return {
        "fit": list(cost.fit_alpha_beta(SIZES, seconds)),
        "ring": [cost.ring_allreduce_seconds(n, w, ALPHA, BETA) for n, w in RINGS],
        "exposed": [cost.exposed_seconds(r, s, end, 2, ALPHA, BETA) for (r, s, end), _ in SCHEDULES],
        "speedup": [cost.speedup(T_COMP, sync, w) for sync, w in SPEEDUPS],
        "largest": [cost.largest_world(T_COMP, sync_growing), cost.largest_world(T_COMP, lambda r: 1.0, most=64)],
    }


def check_fit(folder):
    alpha, beta = alone(answers, folder)["fit"]
    assert math.isclose(alpha, ALPHA, rel_tol=0.02) and math.isclose(beta, BETA, rel_tol=0.02), (
        f"fit_alpha_beta gave alpha {alpha:.3g} s and beta {beta:.3g} B/s for points on T(n) = {ALPHA:g} + n / {BETA:g}:"
        " fit T against n as a straight line; its slope is 1 / beta, its value at n = 0 is alpha"
    )


def check_ring(folder):
    for ((n, w), expected), got in zip(RINGS.items(), alone(answers, folder)["ring"]):
        what = f"ring_allreduce_seconds({n:g} bytes, {w} ranks)"
        if w == 1:
            assert got == 0, f"{what} is {got:.3g} s: one rank sends nothing"
            continue
        assert math.isclose(got, expected, rel_tol=1e-6), f"{what} is {got:.4g} s, not {expected:.4g} s: " + (
            "a ring takes 2(W - 1) steps: W - 1 to reduce-scatter, W - 1 to all-gather"
            if math.isclose(got, expected / 2, rel_tol=1e-6)
            else "each step sends one chunk, n / W bytes, not the whole tensor"
            if math.isclose(got, 2 * (w - 1) * (ALPHA + n / BETA), rel_tol=1e-6)
            else "2(W - 1) steps of alpha + (n / W) / beta each"
        )


def check_exposed(folder):
    for ((ready, sizes, end), expected), got in zip(SCHEDULES, alone(answers, folder)["exposed"]):
        assert math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-12), (
            f"exposed_seconds for buckets ready at {ready} s of {sizes} bytes, backward ending at {end} s, is"
            f" {got:.4g} s, not {expected:.4g} s: a bucket starts at the later of its ready time and the end of the"
            " bucket before it (the maximum, not the sum), and only what ends after the backward pass is exposed"
        )


def check_speedup(folder):
    got = alone(answers, folder)
    for ((sync, w), expected), value in zip(SPEEDUPS.items(), got["speedup"]):
        assert math.isclose(value, expected, rel_tol=1e-6), (
            f"speedup(t_comp={T_COMP}, t_sync={sync}, {w} ranks) is {value:.4g}, not {expected:.4g}: an epoch takes"
            " N / B steps of t_comp on one rank, and N / (R B) steps of t_comp + t_sync on R ranks"
        )
    assert got["largest"] == LARGEST, (
        f"largest_world gave {got['largest']}, expected {LARGEST}: the largest R with T_sync(R) / T_comp < R - 1,"
        " and 1 when no R gains"
    )


def test_fit(impl_dir):
    check_fit(impl_dir)


def test_ring(impl_dir):
    check_ring(impl_dir)


def test_exposed(impl_dir):
    check_exposed(impl_dir)


def test_speedup(impl_dir):
    check_speedup(impl_dir)
