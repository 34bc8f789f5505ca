"""Exercise 2: matrix multiplication split across ranks, by row and by reduction."""

import pytest
import torch
import torch.distributed as dist

from tests.helpers import load, world

# (m, k, n): square, rectangular, divisible by the world sizes or not, and smaller than them.
SHAPES = [(8, 8, 8), (12, 6, 5), (7, 5, 3), (5, 11, 2), (2, 3, 4), (1, 1, 1)]


def operands(i):
    m, k, n = SHAPES[i]
    g = torch.Generator().manual_seed(i)
    return torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)


def multiply_everything(folder):
    """Probe, on every rank: both methods on every shape; A and B exist on rank 0 only."""
    d = load(folder).dist
    rank = dist.get_rank()
    out = []
    for i in range(len(SHAPES)):
        args = operands(i) if rank == 0 else (None, None)
        out.append((d.par_matmul_by_row(*args), d.par_matmul_by_reduction(*args)))
    return out


def check_matmul(folder, world_size):
    results = world(multiply_everything, world_size, folder)
    for rank, per_shape in enumerate(results):
        for i, ((m, k, n), (by_row, by_reduction)) in enumerate(zip(SHAPES, per_shape)):
            A, B = operands(i)
            expected = A @ B
            what = f"with {world_size} ranks, A {m}x{k} @ B {k}x{n}"
            hint = " (scatter sends each piece's memory as it lies: is every piece contiguous?)"
            if rank == 0:
                assert isinstance(by_row, torch.Tensor) and by_row.shape == expected.shape, (
                    f"{what}: par_matmul_by_row should return the {m}x{n} product on rank 0"
                )
                assert torch.allclose(by_row, expected, atol=1e-5), (
                    f"{what}: par_matmul_by_row returned wrong numbers on rank 0{hint}"
                )
            else:
                assert by_row is None, f"{what}: par_matmul_by_row should return None on rank {rank}"
            assert isinstance(by_reduction, torch.Tensor) and by_reduction.shape == expected.shape, (
                f"{what}: par_matmul_by_reduction should return the {m}x{n} product on rank {rank}"
            )
            assert torch.allclose(by_reduction, expected, atol=1e-5), (
                f"{what}: par_matmul_by_reduction returned wrong numbers on rank {rank}{hint}"
            )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_matmul(impl_dir, world_size):
    check_matmul(impl_dir, world_size)
