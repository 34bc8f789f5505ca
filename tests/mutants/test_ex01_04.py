"""The exercise checks catch the mistakes found in published solutions of these exercises.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
known mistake and shows that the check for it fails, with a message that points at the mistake.
"""

import json

import pytest

from checks.helpers import check_equivalence
from checks.test_ex01_mlp import check_forward, check_training
from checks.test_ex02_dist import check_by_reduction, check_by_row
from checks.test_ex03_ddp import check_train_shares_batches
from checks.test_ex04_mydp import check_hook_leaves_its_argument, check_start_sync
from tests import warm
from tests.mutants import assert_caught, make_mutant

MUTANTS = {
    "gradients summed instead of averaged": (
        "mydp.py",
        "mean = grad / dist.get_world_size()",
        "mean = grad.clone()",
        lambda folder: check_equivalence(folder, "mydp", 2),
        "2.0x the expected average",
    ),
    "hook all-reduces the parameter, not its gradient": (
        "mydp.py",
        "param.register_hook(self._average_across_ranks)",
        "param.register_hook(lambda grad, p=param: dist.all_reduce(p.data))",
        lambda folder: check_equivalence(folder, "mydp", 2),
        "gradient of layers",
    ),
    "hook divides its argument in place": (
        "mydp.py",
        "mean = grad / dist.get_world_size()",
        "mean = grad.div_(dist.get_world_size())",
        check_hook_leaves_its_argument,
        "the hook changed the gradient it was given, in place",
    ),
    "hook returns nothing": (
        "mydp.py",
        "        mean = grad / dist.get_world_size()\n        dist.all_reduce(mean, op=dist.ReduceOp.SUM)\n        return mean\n",
        "        pass\n",
        check_hook_leaves_its_argument,
        "the hook returned nothing new",
    ),
    "no initial broadcast": (
        "mydp.py",
        "dist.broadcast(tensor, src=0)",
        "pass",
        lambda folder: check_start_sync(folder, 2),
        "broadcast parameters and buffers from rank 0",
    ),
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
    "every rank trains on the same batches": (
        "mlp.py",
        "if i % world_size != rank:",
        "if False:",
        check_train_shares_batches,
        "i % world_size == r",
    ),
    "every rank trains on the batches of the others": (
        "mlp.py",
        "if i % world_size != rank:",
        "if i % world_size == rank:",
        lambda folder: check_train_shares_batches(folder, 3),
        "after training on 3 ranks",
    ),
    "layers with a bias": (
        "mlp.py",
        "nn.Linear(a, b, bias=False)",
        "nn.Linear(a, b)",
        check_forward,
        "the layers hold layers.0.bias, layers.1.bias, layers.2.bias: the MLP's nn.Linear layers are bias-free",
    ),
    "tanh after the last layer too": (
        "mlp.py",
        "            if i < len(self.layers) - 1:\n                x = torch.tanh(x)",
        "            x = torch.tanh(x)",
        check_forward,
        "logits are wrong: tanh after the last layer too",
    ),
    "test loss computed on training data": (
        "mlp.py",
        '"test_loss": evaluate(model, test_set),',
        '"test_loss": evaluate(model, train_set),',
        check_training,
        "measured on the training data",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])


def test_one_mistake_costs_only_the_checks_of_its_own_promise(tmp_path):
    """Issue 28: each check judges its own promise from its own start. MyDP without its start
    broadcast fails the start checks, and the contract of the same promise (checks/contracts.py: rank 0's
    every parameter and buffer, on a model with a frozen parameter and a non-persistent buffer), and
    no check downstream of them (the steps, frozen parameters, the hook): their judges start the ranks
    from the same parameters themselves."""
    file, old, new, _, hint = MUTANTS["no initial broadcast"]
    folder = make_mutant(tmp_path / "mutant", file, old, new)
    done = warm.grade("--ex", "4", impl=folder, cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(tmp_path / "results.json") as f:
        tests = {t["name"]: t for t in json.load(f)["tests"]}
    failed = sorted(name for name, t in tests.items() if t["status"] == "failed")
    starts = ["Exercise 4: test_start_sync[2]", "Exercise 4: test_start_sync[3]"]
    assert failed == ["Exercise 4: test_contracts", *starts], failed
    assert len(tests) > len(failed) and all(hint in tests[name]["output"] for name in starts)
    assert (
        "every parameter and every buffer, frozen and non-persistent ones too, must be rank 0's"
        in (tests["Exercise 4: test_contracts"]["output"])
    )
    assert done.stdout.count(hint) == 1, f"the table names the mistake once: {done.stdout}"
