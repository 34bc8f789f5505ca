"""Exercise 2: matrix multiplication split across ranks, by row and by reduction."""

import math

import pytest
import torch

from checks.comm_log import ProductFlops
from checks.contracts import check_contracts
from checks.helpers import Given, drawn, load, many, world
from course.grading.points import said

# No world of these checks builds an optimizer: grading them alone need not import torch._dynamo
# (checks/conftest.py).
IMPORTS_DYNAMO = False

# (m, k, n): square, rectangular, divisible by the world sizes or not, and smaller than them.
SHAPES = [(8, 8, 8), (12, 6, 5), (7, 5, 3), (5, 11, 2), (2, 3, 4), (1, 1, 1)]


def operands(i):
    """Shape i's A and B: drawn as the check runs where the grade counts (drawn())."""
    m, k, n = SHAPES[i]
    g = drawn(i)
    return torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)


def multiply_everything(folder, method, given):
    """Probe, on every rank: dist.py's `method` on every shape; A and B are given to rank 0 only (``given``,
    None on the other ranks, whose processes never hold them). With each result, the floating-point
    operations of the products this rank computed (counted at torch's dispatcher, whatever function or
    operator the code used)."""
    multiply = getattr(load(folder).dist, method)
    out = []
    for i in range(len(SHAPES)):
        with ProductFlops() as counted:
            result = multiply(*(given[i] if given is not None else (None, None)))
        out.append((result, counted.flops))
    return out


def multiplied(folder, world_size, method):
    """The shapes' operands, and what each rank returned for each with its flops (multiply_everything)."""
    given = Given(
        lambda: [operands(i) for i in range(len(SHAPES))], lambda cases: [(cases,)] + [(None,)] * (world_size - 1)
    )
    results = world(multiply_everything, world_size, folder, method, expect=PRODUCTS, per_rank=given)
    return given.value, results


# Per shape, what the method returned (the judge tells a product from anything else) and the products' flops.
PRODUCTS = many((object, int), len(SHAPES))


def block_sizes(total, parts):
    """The blocks dist.py cuts: as even as possible, the larger first (its block_sizes, computed here)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _bounds(sizes):
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(a, a + size) for a, size in zip(starts, sizes)]


def _rows(first, last):
    return f"row {first}" if last == first + 1 else f"rows {first}-{last - 1}"


def _as_sent_without_copy(A, parts):
    """A @ B's by-reduction terms as scatter delivers them when a full-width column block of A is a
    view: gloo reads its memory as it lies, so the rank gets A's storage from the block's start."""
    largest, flat = max(parts), A.contiguous().view(-1)
    blocks = []
    for a, b in _bounds(parts):
        raw = b - a == largest and b - a < A.shape[1]
        blocks.append(flat[a : a + A.shape[0] * (b - a)].view(A.shape[0], b - a) if raw else A[:, a:b])
    return blocks


def wrong_product(method, got, expected, A, B, world_size, rank, right_on_rank0):
    """What is wrong with a product, said with the one cause that fits, or as plain facts; its concept
    (course/grading/points.py) names the cause for the class report."""
    m, n = expected.shape
    if tuple(got.shape) != (m, n):
        text = f"a {'x'.join(map(str, got.shape))} tensor, expected {m}x{n}"
        padded = world_size * max(block_sizes(m, world_size))
        if method == "par_matmul_by_row" and tuple(got.shape) == (padded, n):
            return said(
                "padding rows kept",
                text + ": the zero rows that pad the last blocks are still there: keep each block's own rows",
            )
        return said("a product of the wrong shape", text)
    close = lambda x, y: torch.allclose(x, y, atol=1e-5)  # noqa: E731
    if method == "par_matmul_by_reduction":
        if rank != 0 and right_on_rank0:
            return said(
                "right on rank 0 only",
                "wrong numbers, right on rank 0 only: every rank must end with the sum of the partial products",
            )
        parts = block_sizes(A.shape[1], world_size)
        for r, (a, b) in enumerate(_bounds(parts)):
            if b > a and world_size > 1 and close(got, A[:, a:b] @ B[a:b]):
                return said(
                    "partial products not summed",
                    f"wrong numbers: rank {r}'s partial product alone: the partial products must be summed on every rank",
                )
        if world_size > 1 and close(got, world_size * expected):
            return said(
                "each term counted once per rank",
                f"wrong numbers, {world_size} times the product: each term is counted once per rank",
            )
        raw = _as_sent_without_copy(A, parts)
        if close(got, sum(block @ B[a:b] for block, (a, b) in zip(raw, _bounds(parts)))):
            return said(
                "column blocks sent as views",
                "wrong numbers, those of column blocks of A sent as views: a column block is not contiguous,"
                " and scatter sends its memory as it lies (.contiguous())",
            )
    matches = [next((j for j in range(m) if close(got[i], expected[j])), None) for i in range(m)]
    if None not in matches and matches != list(range(m)):
        return said(
            "row blocks joined in the wrong order",
            "wrong numbers: the right rows in the wrong order: join the row blocks in rank order",
        )
    if method == "par_matmul_by_row":
        wrong = [
            f"{_rows(a, b)} (rank {r}'s block)"
            for r, (a, b) in enumerate(_bounds(block_sizes(m, world_size)))
            if b > a and not close(got[a:b], expected[a:b])
        ]
        if len(wrong) < world_size:
            return said(
                "wrong numbers in some ranks' rows", f"wrong numbers in {', '.join(wrong)}; the other rows right"
            )
    error = (got - expected).abs()
    i, j = divmod(int(error.argmax()), n)
    return said("wrong numbers", f"wrong numbers, off by up to {error.max():.3g} (at C[{i}, {j}])")


def _work_split(what, method, flops, m, k, n, world_size, rank):
    """Right numbers may still come from one rank's work: each rank multiplies its block only."""
    if method == "par_matmul_by_row":
        most, share = 2 * n * math.ceil(m / world_size) * k, f"{math.ceil(m / world_size)} of A's rows"
    else:
        most, share = 2 * n * m * math.ceil(k / world_size), f"{math.ceil(k / world_size)} of the k = {k} columns of A"
    assert flops <= most, (
        f"{what}: in {method}, rank {rank} computed {flops} floating-point operations of products, more"
        f" than its block needs ({most}: {share}, padded): each rank multiplies only its own block"
        + (", and rank 0 does not compute the whole product" if flops >= 2 * m * k * n else "")
    )


def check_by_row(folder, world_size):
    """par_matmul_by_row: A @ B on rank 0, None elsewhere, each rank multiplying its rows only."""
    cases, results = multiplied(folder, world_size, "par_matmul_by_row")
    for i, (m, k, n) in enumerate(SHAPES):
        A, B = cases[i]
        expected = A @ B
        what = f"with {world_size} ranks, A {m}x{k} @ B {k}x{n}"
        for rank, per_shape in enumerate(results):
            got, flops = per_shape[i]
            if rank == 0:
                assert isinstance(got, torch.Tensor), said(
                    "no product returned on rank 0",
                    f"{what}: par_matmul_by_row should return the {m}x{n} product on rank 0, got {got!r}",
                )
                if not (got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5)):
                    why = wrong_product("par_matmul_by_row", got, expected, A, B, world_size, 0, True)
                    raise AssertionError(said(why.concept, f"{what}: par_matmul_by_row on rank 0 returned {why}"))
            else:
                assert got is None, said(
                    "a product returned on a rank other than 0",
                    f"{what}: par_matmul_by_row should return None on rank {rank}",
                )
            _work_split(what, "par_matmul_by_row", flops, m, k, n, world_size, rank)


def check_by_reduction(folder, world_size):
    """par_matmul_by_reduction: A @ B on every rank, each rank multiplying its slice of k only."""
    cases, results = multiplied(folder, world_size, "par_matmul_by_reduction")
    for i, (m, k, n) in enumerate(SHAPES):
        A, B = cases[i]
        expected = A @ B
        what = f"with {world_size} ranks, A {m}x{k} @ B {k}x{n}"
        on_rank0 = results[0][i][0]
        right_on_rank0 = isinstance(on_rank0, torch.Tensor) and on_rank0.shape == expected.shape
        right_on_rank0 = right_on_rank0 and torch.allclose(on_rank0, expected, atol=1e-5)
        for rank, per_shape in enumerate(results):
            got, flops = per_shape[i]
            assert isinstance(got, torch.Tensor), (
                f"{what}: par_matmul_by_reduction should return the {m}x{n} product on rank {rank}, got {got!r}"
            )
            if not (got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5)):
                why = wrong_product("par_matmul_by_reduction", got, expected, A, B, world_size, rank, right_on_rank0)
                raise AssertionError(
                    said(why.concept, f"{what}: par_matmul_by_reduction on rank {rank} returned {why}")
                )
            _work_split(what, "par_matmul_by_reduction", flops, m, k, n, world_size, rank)


def check_matmul(folder, world_size):
    """Both methods (for the scripts' tests and the mutants)."""
    check_by_row(folder, world_size)
    check_by_reduction(folder, world_size)


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.points(1)), 2, 3, 4])
@pytest.mark.points(3)
def test_by_row(impl_dir, world_size):
    check_by_row(impl_dir, world_size)


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.points(2)), 2, 3, 4])
@pytest.mark.points(4)
def test_by_reduction(impl_dir, world_size):
    check_by_reduction(impl_dir, world_size)


@pytest.mark.points(1)
def test_contracts(impl_dir):
    """Every promise declared for the exercise's functions in checks/contracts.py: both products keep float64 and bfloat16 inputs' dtype."""
    check_contracts(impl_dir, 2)
