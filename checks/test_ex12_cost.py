"""Exercise 12: the cost model, checked on synthetic measurements whose alpha, beta and T_comp are known,
so that no grade depends on this machine's noise.

Each check runs the cases of its tables, worked out by hand, whose answers a student's copy holds too;
where the grade counts, it also runs cases drawn as it grades, whose answers the reference solutions
compute where no submission runs (checks/helpers.py's judged()): a cost.py that looks its answers up
in these tables is right on the first and wrong on the second."""

import math

import pytest
import torch

from checks.helpers import against_the_judge, alone, drawn, judged, load, many
from course.grading.points import said

# No world of these checks builds an optimizer (checks/conftest.py).
IMPORTS_DYNAMO = False

ALPHA, BETA = 50e-6, 2e9  # 50 us and 2 GB/s: a loopback link of the order this machine has
SIZES = [4e3 * 4**k for k in range(8)]  # 4 kB to 65 MB
# The expected values are worked out by hand (exercises/12_cost.md has the formulas), so that this
# file, which students have, holds no solution. (n bytes, W ranks): seconds.
RINGS = {(1e6, 1): 0.0, (1e6, 2): 600e-6, (3e6, 3): 2.2e-3, (64e6, 4): 0.0483, (1e3, 8): 700.875e-6}
# The ring's time of the buckets below, on 2 ranks: what exposed_seconds gets from ring_allreduce_seconds
# in its check, whatever the student's ring gives (test_ring judges that).
BUCKET_RINGS = {(1e6, 2): 600e-6, (4e6, 2): 2.1e-3, (1e3, 2): 100.5e-6}
# Buckets on 2 ranks: (ready times, bytes, end of the backward pass) and the exposed seconds.
# An idle link between buckets; a queue; everything done before the backward pass ends; a bucket ready before
# the one that launches ahead of it (it still waits its turn on the link).
SCHEDULES = [
    (([0.001, 0.004, 0.009], [1e6, 1e6, 1e6], 0.0092), 0.0004),
    (([0.000, 0.000, 0.001], [4e6, 4e6, 4e6], 0.002), 0.0043),
    (([0.000, 0.005], [1e3, 1e3], 0.020), 0.0),
    (([0.002, 0.000], [1e3, 4e6], 0.002), 0.0022005),
]
# What known mistakes give on SCHEDULES, worked out by hand likewise, and what to say of each.
EXPOSED_MISTAKES = [
    (
        [0.0066, 0.0053, 0.0, 0.0022005],
        "a bucket's start the sum of its ready time and the previous bucket's end",
        "a bucket starts at the later of its ready time and the end of the bucket before it: their maximum,"
        " not their sum",
    ),
    (
        [0.0004, 0.0011, 0.0, 0.0001],
        "a bucket's all-reduce not waiting for the one before it",
        "a bucket's all-reduce also waits for the link: it starts when the all-reduce of the bucket before it"
        " has ended, if that is later than its ready time",
    ),
    (
        [0.0004, 0.0043, -0.0148995, 0.0022005],
        "a negative exposed time",
        "communication that ends before the backward pass does is not exposed: the optimizer waits 0 s, not a"
        " negative time",
    ),
    (
        [0.0004, 0.0043, 0.0, 0.0002005],
        "buckets taken in the order of their ready times",
        "the buckets go on the link in the order they launch, the order of the lists: a bucket whose gradients are"
        " ready before the one ahead of it still waits for that one's all-reduce",
    ),
]
T_COMP = 0.010
# (t_sync, W): speed-up, with T_COMP.
SPEEDUPS = {(0.0, 1): 1.0, (0.005, 2): 4 / 3, (0.030, 4): 1.0}


class Power:
    """A T_sync that grows as a power of the ranks added, scale (R - 1)^power: a drawn case's, picklable."""

    def __init__(self, scale, power):
        self.scale, self.power = scale, power

    def __call__(self, ranks):
        return self.scale * (ranks - 1) ** self.power


def sync_growing(ranks):
    """T_sync growing faster than the ranks: 0.3 sqrt(R - 1) < 1 up to R = 12."""
    return 0.003 * (ranks - 1) ** 1.5


def sync_on_the_edge(ranks):
    """With T_comp = 0.25 s: T_sync / T_comp = (R - 1)^2 / 4, below R - 1 up to R = 4 and equal to it at R = 5
    (exactly, in floats)."""
    return (ranks - 1) ** 2 / 16


def sync_slow_in_the_middle(ranks):
    """A link that is slow for 4 and 5 ranks only (their layout crosses a slower switch, say)."""
    return 1.0 if ranks in (4, 5) else 0.001


# (t_comp, t_sync_of, most): the largest world, and what known wrong searches give instead, with what to say.
# most None: not given, so its default, 1024, which predict relies on; last, so that a wrong search is named first.
LARGEST = [
    ((T_COMP, sync_growing, 1024), 12, {}),
    ((T_COMP, Power(1.0, 0), 64), 1, {}),
    ((T_COMP, Power(0.001, 0), 16), 16, {15: "most itself is a candidate: the range goes up to most, included"}),
    ((0.25, sync_on_the_edge, 64), 4, {5: "at R = 5 the two are equal, and the condition is strict (<)"}),
    ((T_COMP, Power(0.005, 3), 32), 2, {1: "the candidates start at R = 2"}),
    (
        (T_COMP, sync_slow_in_the_middle, 8),
        8,
        {3: "R = 4 and 5 do not gain but 6 to 8 do: try every R, do not stop at the first that fails"},
    ),
    ((T_COMP, Power(0.001, 0), None), 1024, {}),
]


# Off the line by 4, -5 and 1 us at the three smallest sizes (4, 16 and 64 kB): deviations whose sum, and sum
# weighted by n, are 0, so the least-squares line is still ALPHA + n / BETA, while a line through two of the
# points, or one that ignores the intercept, is not.
SKEW = [4e-6, -5e-6, 1e-6] + [0.0] * (len(SIZES) - 3)


def measurements(alpha=ALPHA, beta=BETA, seed=0):
    """The points the fit is given: on T(n) = alpha + n / beta, but for SKEW and noise of 0.1 us (both scaled
    with alpha from ALPHA's)."""
    noise = torch.Generator().manual_seed(seed)
    scale = alpha / ALPHA
    return [
        alpha + n / beta + (skew + float(torch.randn(1, generator=noise)) * 1e-7) * scale
        for n, skew in zip(SIZES, SKEW)
    ]


def fit_answer(folder, seconds):
    """Probe: fit_alpha_beta on the measurements."""
    return list(load(folder).cost.fit_alpha_beta(SIZES, seconds))


def ring_answers(folder, cases):
    """Probe: ring_allreduce_seconds of every case, (n, world_size, alpha, beta)."""
    cost = load(folder).cost
    return [cost.ring_allreduce_seconds(*case) for case in cases]


class RingTable:
    """ring_allreduce_seconds as exposed_seconds's check gives it: the ring's time of each bucket, from a table
    of (bytes, world_size): seconds, whatever the student's ring gives (test_ring judges that)."""

    def __init__(self, seconds, alpha, beta):
        self.seconds, self.alpha, self.beta = seconds, alpha, beta

    def __call__(self, n, world_size, alpha, beta):
        if (n, world_size) not in self.seconds or (alpha, beta) != (self.alpha, self.beta):
            raise ValueError(
                f"exposed_seconds called ring_allreduce_seconds({n:g}, {world_size}, {alpha:g}, {beta:g}), not the"
                " all-reduce of one of its buckets: call it with the bucket's bytes, world_size, alpha and beta"
            )
        return self.seconds[(n, world_size)]


def exposed_answers(folder, schedules, rings):
    """Probe: exposed_seconds of every schedule, (ready, sizes, end) on 2 ranks, its ring_allreduce_seconds
    answering from rings (a RingTable)."""
    cost = load(folder).cost
    cost.ring_allreduce_seconds = rings
    return [cost.exposed_seconds(r, s, end, 2, rings.alpha, rings.beta) for r, s, end in schedules]


def speedup_answers(folder, cases):
    """Probe: speedup of every case, (t_comp, t_sync, world_size)."""
    cost = load(folder).cost
    return [cost.speedup(*case) for case in cases]


def largest_answers(folder, cases):
    """Probe: largest_world of every case, (t_comp, t_sync_of, most), most None: not given."""
    cost = load(folder).cost
    return [
        cost.largest_world(t_comp, sync_of) if most is None else cost.largest_world(t_comp, sync_of, most=most)
        for t_comp, sync_of, most in cases
    ]


def _log_uniform(g, low, high):
    return 10 ** (low + (high - low) * float(torch.rand(1, generator=g)))


def _integer(g, low, high):
    return int(torch.randint(low, high + 1, (1,), generator=g))


def drawn_answers(probe, folder, cases, *more, what):
    """The submission's answers to cases drawn as the grade runs (one number each; probe(folder, cases, *more)),
    judged against the reference's."""
    expect = many(float, len(cases))
    got = alone(probe, folder, cases, *more, expect=expect)
    close = lambda a, b: math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)  # noqa: E731
    against_the_judge(got, probe, cases, *more, expect=expect, what=what, same=close, shown=lambda v: f"{v:.6g}")


def check_fit(folder):
    """fit_alpha_beta gives the least-squares line of the measurements, T(n) = alpha + n / beta."""
    fit_of(folder, ALPHA, BETA, measurements())
    if judged():  # the line that made the points is the answer: no reference needed
        g = drawn(0)
        alpha, beta = _log_uniform(g, -5.5, -4), _log_uniform(g, 8.5, 10.5)
        fit_of(folder, alpha, beta, measurements(alpha, beta, _integer(g, 0, 2**31)))


def fit_of(folder, alpha_made, beta_made, seconds):
    alpha, beta = alone(fit_answer, folder, seconds, expect=(float, float))
    if math.isclose(alpha, alpha_made, rel_tol=0.02) and math.isclose(beta, beta_made, rel_tol=0.02):
        return
    ends = (seconds[-1] - seconds[0]) / (SIZES[-1] - SIZES[0])
    if math.isclose(beta, 1 / beta_made, rel_tol=0.02):
        concept, why = "beta taken as the slope, not its inverse", ": the slope of T against n is 1 / beta, not beta"
    elif math.isclose(alpha, seconds[0] - ends * SIZES[0], rel_tol=0.02) or math.isclose(beta, 1 / ends, rel_tol=1e-3):
        concept = "a line through the first and last points, not least squares"
        why = ": that is the line through the first and last points; least squares weighs every point"
    else:
        concept, why = "not the least-squares line of the measurements", ""
    raise AssertionError(
        said(
            concept,
            f"fit_alpha_beta gave alpha {alpha:.3g} s and beta {beta:.3g} B/s for {len(SIZES)} points whose"
            f" least-squares line T(n) = alpha + n / beta has alpha {alpha_made:.3g} s and beta {beta_made:.3g} B/s"
            f"{why}",
        )
    )


def check_ring(folder):
    """ring_allreduce_seconds is 2(W - 1) steps of alpha + (n / W) / beta each, and 0 on one rank."""
    cases = [(n, w, ALPHA, BETA) for n, w in RINGS]
    for ((n, w), expected), got in zip(
        RINGS.items(), alone(ring_answers, folder, cases, expect=many(float, len(RINGS)))
    ):
        what = f"ring_allreduce_seconds({n:g} bytes, {w} ranks)"
        if w == 1:
            assert got == 0, said(
                "a ring of one rank that takes time", f"{what} is {got:.3g} s: one rank sends nothing"
            )
            continue
        if math.isclose(got, expected, rel_tol=1e-6):
            continue
        if math.isclose(got, expected / 2, rel_tol=1e-6):
            concept, why = (
                "a ring of W - 1 steps, not 2(W - 1)",
                "a ring takes 2(W - 1) steps: W - 1 to reduce-scatter, W - 1 to all-gather",
            )
        elif math.isclose(got, 2 * (w - 1) * (ALPHA + n / BETA), rel_tol=1e-6):
            concept, why = (
                "each ring step sending the whole tensor, not n / W",
                "each step sends one chunk, n / W bytes, not the whole tensor",
            )
        else:
            concept, why = (
                "not 2(W - 1) steps of alpha + (n / W) / beta",
                "2(W - 1) steps of alpha + (n / W) / beta each",
            )
        raise AssertionError(said(concept, f"{what} is {got:.4g} s, not {expected:.4g} s: {why}"))
    if judged():
        g = drawn(1)
        cases = [
            (_log_uniform(g, 3, 8), _integer(g, 2, 16), _log_uniform(g, -6, -4), _log_uniform(g, 8, 11))
            for _ in range(5)
        ]
        drawn_answers(
            ring_answers,
            folder,
            cases,
            what=lambda k: "ring_allreduce_seconds({:.6g} bytes, {} ranks, alpha {:.3g} s, beta {:.3g} B/s)".format(
                *cases[k]
            ),
        )


def check_exposed(folder):
    """exposed_seconds is the time the optimizer waits after the backward pass for the buckets' all-reduces (given a
    ring_allreduce_seconds that answers right for its buckets)."""
    rings = RingTable(BUCKET_RINGS, ALPHA, BETA)
    schedules = [schedule for schedule, _ in SCHEDULES]
    got = alone(exposed_answers, folder, schedules, rings, expect=many(float, len(SCHEDULES)))
    for k, (((ready, sizes, end), expected), value) in enumerate(zip(SCHEDULES, got)):
        if math.isclose(value, expected, rel_tol=1e-6, abs_tol=1e-12):
            continue
        concept, why = next(
            (
                (concept, say)
                for values, concept, say in EXPOSED_MISTAKES
                if math.isclose(value, values[k], rel_tol=1e-6, abs_tol=1e-12)
            ),
            ("not the optimizer's wait after the backward pass", ""),
        )
        raise AssertionError(
            said(
                concept,
                f"exposed_seconds for buckets ready at {ready} s of {sizes} bytes on 2 ranks (all-reduces of"
                f" {_rings_of(rings, sizes)}), backward ending at {end} s, is {value:.4g} s, not {expected:.4g} s"
                + (f": {why}" if why else ""),
            )
        )
    if judged():
        g = drawn(2)
        sizes = [round(_log_uniform(g, 3, 7)) for _ in range(3)]
        rings = RingTable({(n, 2): _log_uniform(g, -5, -2.5) for n in sizes}, _log_uniform(g, -6, -4), 2e9)
        schedules = []
        for _ in range(4):
            ready = [0.01 * float(torch.rand(1, generator=g)) for _ in range(_integer(g, 2, 5))]
            buckets = [sizes[_integer(g, 0, 2)] for _ in ready]
            # Before the end of the bucket ready last, so that every drawn wait is more than 0: an answer that is
            # 0 whatever the buckets never passes them.
            shortest = min(rings.seconds[(n, 2)] for n in buckets)
            end = max(ready) + 0.9 * shortest * float(torch.rand(1, generator=g))
            schedules.append((ready, buckets, end))
        drawn_answers(
            exposed_answers,
            folder,
            schedules,
            rings,
            what=lambda k: (
                f"exposed_seconds for buckets ready at {[f'{t:.4g}' for t in schedules[k][0]]} s of"
                f" {schedules[k][1]} bytes on 2 ranks (all-reduces of {_rings_of(rings, schedules[k][1])}),"
                f" backward ending at {schedules[k][2]:.4g} s"
            ),
        )


def _rings_of(rings, sizes):
    return ", ".join(f"{rings.seconds[(n, 2)]:.4g} s" for n in sizes)


def check_speedup(folder):
    """speedup is one rank's epoch time over R ranks', N / B steps of t_comp against N / (R B) of t_comp + t_sync."""
    cases = [(T_COMP, sync, w) for sync, w in SPEEDUPS]
    for ((sync, w), expected), value in zip(
        SPEEDUPS.items(), alone(speedup_answers, folder, cases, expect=many(float, len(SPEEDUPS)))
    ):
        assert math.isclose(value, expected, rel_tol=1e-6), (
            f"speedup(t_comp={T_COMP}, t_sync={sync}, {w} ranks) is {value:.4g}, not {expected:.4g}: an epoch takes"
            " N / B steps of t_comp on one rank, and N / (R B) steps of t_comp + t_sync on R ranks"
        )
    if judged():
        g = drawn(3)
        cases = [(_log_uniform(g, -3, -1), _log_uniform(g, -4, -1), _integer(g, 1, 64)) for _ in range(5)]
        drawn_answers(
            speedup_answers,
            folder,
            cases,
            what=lambda k: "speedup(t_comp={:.4g}, t_sync={:.4g}, {} ranks)".format(*cases[k]),
        )


def check_largest_world(folder):
    """largest_world finds the largest R from 2 to most (1024 when not given) for which T_sync / T_comp < R - 1."""
    cases = [case for case, _, _ in LARGEST]
    for ((t_comp, sync_of, most), expected, mistakes), value in zip(
        LARGEST, alone(largest_answers, folder, cases, expect=many(float, len(LARGEST)))
    ):
        given, upto = ("most not given", 1024) if most is None else (f"most={most}", most)
        why = mistakes.get(value) or (
            "without most, the search goes up to 1024, the default that predict relies on" if most is None else ""
        )
        ratios = ", ".join(f"R={r}: {sync_of(r) / t_comp:.3g}" for r in range(2, min(upto, 8) + 1))
        assert value == expected, said(
            why or "not the largest world that gains",
            f"largest_world(t_comp={t_comp}, {given}) gave {value}, expected {expected}, the largest R from 2 to"
            f" most with T_sync(R) / T_comp < R - 1 (T_sync / T_comp is {ratios}{', ...' if upto > 8 else ''})"
            + (f": {why}" if why else ""),
        )
    if judged():
        g = drawn(4)
        cases = []
        for _ in range(5):
            # T_sync / T_comp = (R - 1)^power / crossing^(power - 1) is below R - 1 exactly while R - 1 < crossing,
            # a half-integer below most: the answer is neither 1 nor most, and no R is a tie.
            t_comp, most = _log_uniform(g, -3, -1), _integer(g, 8, 300)
            power, crossing = 1.5 + 1.5 * float(torch.rand(1, generator=g)), _integer(g, 2, most - 3) + 0.5
            cases.append((t_comp, Power(t_comp * crossing ** (1 - power), power), most))
        drawn_answers(
            largest_answers,
            folder,
            cases,
            what=lambda k: (
                f"largest_world(t_comp={cases[k][0]:.4g}, T_sync(R) = {cases[k][1].scale:.4g} (R - 1)^"
                f"{cases[k][1].power:.3g}, most={cases[k][2]})"
            ),
        )


@pytest.mark.points(4)
def test_fit(impl_dir):
    check_fit(impl_dir)


@pytest.mark.points(4)
def test_ring(impl_dir):
    check_ring(impl_dir)


@pytest.mark.points(4)
def test_exposed(impl_dir):
    check_exposed(impl_dir)


@pytest.mark.points(4)
def test_speedup(impl_dir):
    check_speedup(impl_dir)


@pytest.mark.points(4)
def test_largest_world(impl_dir):
    check_largest_world(impl_dir)
