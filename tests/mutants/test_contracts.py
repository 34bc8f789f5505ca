"""The contract checks (checks/contracts.py) catch a broken promise of each kind, and name it.

Instructors only: these need solutions/. Each case makes a mutant of the reference that breaks one
declared promise, as a careful student might, and shows that the check fails with a sentence that
names the promise, not a later comparison.
"""

import pytest

from checks.contracts import check_contracts
from checks.test_ex03_ddp import check_closeness, check_train_shares_batches
from tests.mutants import assert_caught

MUTANTS = {
    # returns: a tensor where a float is promised (float(result) downstream would hide it).
    "evaluate returns a tensor": (
        "mlp.py",
        "        losses.append(loss.item())\n    model.train()",
        "        losses.append(loss)\n    model.train()",
        lambda folder: check_contracts(folder, 1),
        "evaluate returned a Tensor; it must return a float",
    ),
    "accumulation_step returns a tensor": (
        "mydp.py",
        "total += loss.item() / micro_batches",
        "total += loss.detach() / micro_batches",
        lambda folder: check_contracts(folder, 7),
        "accumulation_step returned a Tensor; it must return a float",
    ),
    # returns: 1.0 where a bool is promised, named as the type by the checks that read it.
    "check_parameter_closeness returns 1.0": (
        "mlp.py",
        "return bool(verdict.item())",
        "return verdict.item()",
        lambda folder: check_closeness(folder, 2),
        "check_parameter_closeness returned a float; it must return a bool",
    ),
    "check_parameter_closeness returns 1.0, read by train": (
        "mlp.py",
        "return bool(verdict.item())",
        "return verdict.item()",
        check_train_shares_batches,
        "check_parameter_closeness returned a float; it must return a bool",
    ),
    # within_tolerance: an exact comparison where torch.allclose is asked.
    "check_parameter_closeness compares exactly": (
        "mlp.py",
        "torch.allclose(everyone[0], other)",
        "torch.equal(everyone[0], other)",
        lambda folder: check_contracts(folder, 3),
        "compare with torch.allclose, not exactly",
    ),
    # dtypes: a comparison of parameters of any dtype.
    "check_parameter_closeness gathers into float32 buffers": (
        "mlp.py",
        "everyone = [torch.empty_like(mine) for _ in range(world_size)]",
        "everyone = [torch.empty(mine.numel()) for _ in range(world_size)]",
        lambda folder: check_contracts(folder, 3),
        "Invalid usage of tensors with different dtypes",
    ),
    "check_parameter_closeness answers False for another dtype than float32": (
        "mlp.py",
        "return bool(verdict.item())",
        "return bool(verdict.item()) and mine.dtype == torch.float32",
        lambda folder: check_contracts(folder, 3),
        "for float64 parameters that are equal on every rank; it must return True",
    ),
    # frozen: every parameter, frozen ones too.
    "check_parameter_closeness compares the trainable parameters only": (
        "mlp.py",
        "    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])\n",
        "    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])\n",
        lambda folder: check_contracts(folder, 3),
        "check_parameter_closeness returned True for ranks that differ in a frozen parameter (requires_grad=False)"
        " alone; it must return False: every parameter counts, frozen ones too",
    ),
    "ShardedOptimizer all-reduces a frozen parameter's missing gradient": (
        "zero.py",
        "            if p.grad is not None:  # a frozen parameter has none, on every rank\n"
        "                dist.all_reduce(p.grad)\n                p.grad /= dist.get_world_size()\n",
        "            dist.all_reduce(p.grad)\n            p.grad /= dist.get_world_size()\n",
        lambda folder: check_contracts(folder, 11),
        "step raised TypeError: Invalid function argument",
    ),
    # world_sizes: fails in the smallest legal world, a world of one.
    "check_parameter_closeness fails in a world of one": (
        "mlp.py",
        "torch.allclose(everyone[0], other) for other in everyone[1:]",
        "torch.allclose(everyone[1], other) for other in everyone",
        lambda folder: check_contracts(folder, 3),
        "IndexError",
    ),
    # in_place: a rebinding, which reading the attribute again would take for an update.
    "running statistics rebound, not updated in place": (
        "sync.py",
        "self.running_mean.lerp_(mean, self.momentum)",
        "self.running_mean = self.running_mean.lerp(mean, self.momentum)",
        lambda folder: check_contracts(folder, 9),
        "put new tensors in place of running_mean",
    ),
    "broadcast_parameters hands the model new tensors": (
        "hvd.py",
        "            dist.broadcast(tensor, src=0)\n",
        "            received = tensor.detach().clone()\n            dist.broadcast(received, src=0)\n"
        "            tensor.data = received\n",
        lambda folder: check_contracts(folder, 10),
        "put new tensors in place of",
    ),
    # dtypes: float32 is the only dtype a hand-picked case tries.
    "par_matmul_by_row casts the product to float32": (
        "dist.py",
        "my_C = (my_rows @ B).contiguous()",
        "my_C = (my_rows @ B).float()",
        lambda folder: check_contracts(folder, 2),
        "par_matmul_by_row returned a float32 tensor for float64 inputs; it must keep the inputs' dtype",
    ),
    "par_matmul_by_row receives B as float32": (
        "dist.py",
        "        B = torch.empty(k, n, dtype=dtype)",
        "        B = torch.empty(k, n)",
        lambda folder: check_contracts(folder, 2),
        "with a different dtype",
    ),
    "bucket_parameters counts 4 bytes per element": (
        "mydp.py",
        "nbytes = param.numel() * param.element_size()",
        "nbytes = param.numel() * 4",
        lambda folder: check_contracts(folder, 6),
        "bytes of float64 gradients in one bucket, cap_bytes=160",
    ),
    # group: a hook run on the default group only cannot show which group it uses.
    "bf16_average_hook all-reduces on the default group": (
        "zero.py",
        "dist.all_reduce(compressed, group=group, async_op=True)",
        "dist.all_reduce(compressed, async_op=True)",
        lambda folder: check_contracts(folder, 11),
        "bf16_average_hook all-reduced on another group than the one DDP called it with",
    ),
    # syncs: the parameters and buffers easiest to forget.
    "broadcast_parameters skips frozen parameters": (
        "hvd.py",
        "for tensor in [*model.parameters(), *model.buffers()]:",
        "for tensor in [*(p for p in model.parameters() if p.requires_grad), *model.buffers()]:",
        lambda folder: check_contracts(folder, 10),
        "0.bias (a frozen parameter) is not rank 0's",
    ),
    "MyDP broadcasts only the parameters that train": (
        "mydp.py",
        "for tensor in list(model.parameters()) + list(model.buffers()):",
        "for tensor in [p for p in model.parameters() if p.requires_grad] + list(model.buffers()):",
        lambda folder: check_contracts(folder, 4),
        "after MyDP(model), rank 1's 0.bias (a frozen parameter) is not rank 0's",
    ),
    "OverlappedDP broadcasts the state dict": (
        "mydp.py",
        "for state in [*model.parameters(), *model.buffers()]:",
        "for state in model.state_dict().values():",
        lambda folder: check_contracts(folder, 6),
        "after OverlappedDP(model), rank 1's scale (a non-persistent buffer) is not rank 0's",
    ),
    "broadcast_parameters skips non-persistent buffers": (
        "hvd.py",
        "for tensor in [*model.parameters(), *model.buffers()]:",
        "for tensor in model.state_dict().values():",
        lambda folder: check_contracts(folder, 10),
        "scale (a non-persistent buffer) is not rank 0's",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])
