"""The checks of exercise 2 catch the mistakes found in published solutions of the matrix products.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
mistake and shows that the check for it fails, with a message that points at the mistake.
"""

import pytest

from checks.test_ex02_dist import check_by_reduction, check_by_row
from tests.mutants import assert_caught

MUTANTS = {
    "non-contiguous scatter pieces": (
        "dist.py",
        "blocks.append(torch.cat([block, block.new_zeros(pad)], dim=dim).contiguous())",
        "blocks.append(block if pad[dim] == 0 else torch.cat([block, block.new_zeros(pad)], dim=dim))",
        lambda folder: check_by_reduction(folder, 2),
        "column blocks of A sent as views",
    ),
    "row blocks joined in the wrong order": (
        "dist.py",
        "zip(pieces, rows)",
        "zip(pieces[::-1], rows[::-1])",
        lambda folder: check_by_row(folder, 2),
        "the right rows in the wrong order",
    ),
    "padding rows kept after the gather": (
        "dist.py",
        "torch.cat([piece[:size] for piece, size in zip(pieces, rows)])",
        "torch.cat(pieces)",
        lambda folder: check_by_row(folder, 3),
        "a 9x8 tensor, expected 8x8: the zero rows that pad the last blocks are still there",
    ),
    "B never broadcast": (
        "dist.py",
        "    dist.broadcast(B, src=0)\n",
        "    B = torch.zeros(k, n, dtype=dtype) if rank != 0 else B\n",
        lambda folder: check_by_row(folder, 2),
        "wrong numbers in rows 4-7 (rank 1's block); the other rows right",
    ),
    "reduce where all_reduce is needed": (
        "dist.py",
        "dist.all_reduce(C, op=dist.ReduceOp.SUM)",
        "dist.reduce(C, dst=0, op=dist.ReduceOp.SUM)",
        lambda folder: check_by_reduction(folder, 2),
        "right on rank 0 only",
    ),
    "partial products never summed": (
        "dist.py",
        "    dist.all_reduce(C, op=dist.ReduceOp.SUM)\n",
        "",
        lambda folder: check_by_reduction(folder, 2),
        "partial product alone",
    ),
    "torch.split given a chunk size where a number of chunks was meant": (
        "dist.py",
        "torch.split(matrix, sizes, dim=dim)",
        "torch.split(matrix, len(sizes), dim=dim)",
        lambda folder: check_by_row(folder, 3),
        "gave scatter 4 tensors for 3 ranks: its list takes one tensor per rank",
    ),
    "rank 0 multiplies everything, the others receive their rows of the product": (
        "dist.py",
        "    my_C = (my_rows @ B).contiguous()\n",
        "    my_C = torch.empty(max(rows), n, dtype=dtype)\n"
        "    dist.scatter(my_C, padded_blocks(A @ B, rows, dim=0) if rank == 0 else None, src=0)\n",
        lambda folder: check_by_row(folder, 2),
        "rank 0 computed 1024 floating-point operations of products, more than its block needs (512: 4 of A's rows,"
        " padded): each rank multiplies only its own block, and rank 0 does not compute the whole product",
    ),
    "rank 0 multiplies everything, the all-reduce adds zeros to it": (
        "dist.py",
        "    C = my_A @ my_B\n",
        "    C = A @ B if rank == 0 else torch.zeros(m, n, dtype=dtype)\n",
        lambda folder: check_by_reduction(folder, 3),
        "in par_matmul_by_reduction, rank 0 computed 1024 floating-point operations of products",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])
