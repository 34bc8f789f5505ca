# Your copy of the exercise code: fill in every TODO, then `make grade` checks it.
"""Exercises 2 and 5: multiply matrices across workers with collectives; all-reduce around a ring.

    python dist.py                   # two workers
    python dist.py --world-size 3
    python dist.py --world-size 3 --ring 10   # exercise 5: ring all-reduce of 10 numbers

The matrix products run on every rank of a process group. A (m x k) and B (k x n) exist on rank
0 only; the other ranks are passed None and learn everything, shapes included, by communication.
Handouts: exercises/02_dist.md, exercises/05_ring.md.
"""

import argparse
import os

import torch
import torch.distributed as dist

from course.device import current_device
from course.launch import add_launch_arguments, launch, launch_options


def block_sizes(total, parts):
    """Split `total` rows into `parts` blocks as even as possible: block_sizes(7, 3) == [3, 2, 2]."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def share_shapes(A, B):
    """Rank 0 tells every rank the shapes (m, k, n) and the dtype; returns them on every rank."""
    meta = [(A.shape[0], A.shape[1], B.shape[1], A.dtype) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(meta, src=0)
    return meta[0]


def padded_blocks(matrix, sizes, dim):
    """Cut matrix along dim into blocks of the given sizes, each zero-padded to the largest size.

    gloo's scatter and gather move equal-sized tensors only, and they read each tensor's memory
    as it lies: every block must be contiguous, or a rank silently receives the wrong numbers.
    """
    largest = max(sizes)
    blocks = []
    for block in torch.split(matrix, sizes, dim=dim):
        pad = list(block.shape)
        pad[dim] = largest - block.shape[dim]
        blocks.append(torch.cat([block, block.new_zeros(pad)], dim=dim).contiguous())
    return blocks


def par_matmul_by_row(A: torch.Tensor | None, B: torch.Tensor | None) -> torch.Tensor | None:
    """Return A @ B on rank 0 and None on the other ranks, computed by rows.

    Broadcast B to every rank, scatter row blocks of A (dist.scatter), multiply locally, and
    gather the row blocks of C back to rank 0 (dist.gather). m need not divide by the world size.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    m, k, n, dtype = share_shapes(A, B)
    # TODO(exercise 2): broadcast B, scatter A's row blocks, multiply, gather C's row blocks.
    raise NotImplementedError("Exercise 2: par_matmul_by_row is not written yet, see exercises/02_dist.md")


def par_matmul_by_reduction(A: torch.Tensor | None, B: torch.Tensor | None) -> torch.Tensor:
    """Return A @ B on every rank, computed by splitting the reduction dimension k.

    Scatter column blocks of A and row blocks of B, multiply locally into a full m x n partial
    product, and sum the partial products on every rank with dist.all_reduce.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    m, k, n, dtype = share_shapes(A, B)
    # TODO(exercise 2): scatter A's column blocks and B's row blocks, multiply, all_reduce.
    raise NotImplementedError("Exercise 2: par_matmul_by_reduction is not written yet, see exercises/02_dist.md")


def exchange(outgoing: torch.Tensor, incoming: torch.Tensor, right: int, left: int) -> None:
    """Send `outgoing` to rank `right` while receiving `incoming` from rank `left`; return when both are done.

    Every rank calls it at the same time, each sending to its right and receiving from its left.
    If every rank first sent with the blocking dist.send and only then received, each would wait
    for a receiver that never comes. On NCCL the send and the receive must also start together
    (see exercises/05_ring.md).
    """
    # TODO(exercise 5): send to the right and receive from the left, both at once; wait for both.
    raise NotImplementedError("Exercise 5: exchange is not written yet, see exercises/05_ring.md")


def ring_all_reduce(tensor: torch.Tensor) -> None:
    """Sum a contiguous tensor over all ranks, in place, with point-to-point messages only.

    Rank r talks only to its neighbours on a ring: it sends to r + 1 and receives from r - 1
    (modulo the world size). `chunks` cuts the tensor into one view per rank (some are empty
    when the tensor is shorter than the world). Reduce-scatter: in W - 1 steps every rank passes
    one chunk on and adds the chunk that arrives to its own, until each rank holds one chunk
    summed over all ranks. All-gather: in W - 1 more steps the summed chunks travel around the
    ring, overwriting the partial ones. No collective (dist.all_reduce and the like) may be used.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    chunks = tensor.view(-1).tensor_split(world_size)
    # TODO(exercise 5): reduce-scatter then all-gather, one chunk each way per step (exchange).
    raise NotImplementedError("Exercise 5: ring_all_reduce is not written yet, see exercises/05_ring.md")


def relative_difference(C, expected):
    """The largest |C - expected|, as a fraction of the largest |expected|.

    float32 keeps about 7 significant digits, so the rounding of a sum of k products grows with
    the size of its terms and with k: a fixed absolute tolerance rejects correct large products
    (a 4000x3000 @ 3000x2000 product by reduction is 9e-5 off in places, 3e-7 of its scale).
    """
    return ((C - expected).abs().max() / expected.abs().max()).item()


# What relative_difference may be for products computed in two different summation orders.
MATMUL_TOLERANCE = 1e-5


def do_work(m, k, n):
    """Run on every rank: say who we are, multiply both ways, and check the results on rank 0."""
    rank, device = dist.get_rank(), current_device()
    print(f"My rank is {os.environ['RANK']}, same as {rank}", flush=True)
    A = B = None
    if rank == 0:
        g = torch.Generator().manual_seed(0)
        A, B = torch.randn(m, k, generator=g).to(device), torch.randn(k, n, generator=g).to(device)
    with device:  # tensors made inside (torch.empty) land on this rank's device: nccl moves GPU tensors only
        results = {"by row": par_matmul_by_row(A, B), "by reduction": par_matmul_by_reduction(A, B)}
    if rank != 0:
        return True
    ok = True
    for method, C in results.items():
        right = C is not None and C.shape == (m, n) and relative_difference(C, A @ B) <= MATMUL_TOLERANCE
        print(f"{method}: {'matches' if right else 'does NOT match'} A @ B ({m}x{k} @ {k}x{n})")
        ok = ok and right
    return ok


def ring_work(length):
    """Run on every rank: ring_all_reduce `length` numbers and compare with dist.all_reduce."""
    rank = dist.get_rank()
    mine = torch.arange(length, dtype=torch.float32, device=current_device()) * (
        rank + 1
    )  # whole numbers: sums are exact
    expected = mine.clone()
    dist.all_reduce(expected)
    ring_all_reduce(mine)
    same = torch.equal(mine, expected)
    if rank == 0:
        print(
            f"ring_all_reduce of {length} numbers on {dist.get_world_size()} ranks:"
            f" {'matches' if same else 'does NOT match'} dist.all_reduce"
        )
    return same


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--shape", type=int, nargs=3, default=(7, 5, 3), metavar=("M", "K", "N"))
    parser.add_argument(
        "--ring", type=int, default=None, metavar="N", help="instead, check ring_all_reduce on N numbers (exercise 5)"
    )
    add_launch_arguments(parser)
    args = parser.parse_args()
    if args.ring is not None:
        raise SystemExit(0 if all(launch(ring_work, args.world_size, args.ring, **launch_options(args))) else 1)
    results = launch(do_work, args.world_size, *args.shape, **launch_options(args))
    raise SystemExit(0 if all(results) else 1)

# ruff: noqa: F401, F821, F841, B007 - what a stub leaves unused or undefined until it is written
