"""The checks of exercise 14 catch the mistakes of tensor and sequence parallelism.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
mistake and shows that the check for it fails, with a message that points at the mistake.
"""

import os

import pytest

from checks.test_ex14_tp import (
    check_backward,
    check_collectives,
    check_forward,
    check_function,
    check_kernel_count,
    check_matches_torch,
    check_norms,
    check_shards,
    check_train_steps,
    check_uneven,
)
from course.layout import SOLUTIONS
from tests.mutants import assert_caught, assert_refused, assert_torch_own_caught

with open(os.path.join(SOLUTIONS, "tp.py")) as f:
    SOURCE = f.read()


def span(first, last):
    """The reference's text from `first` to the end of `last`: a mistake made in two places at once."""
    start = SOURCE.index(first)
    return SOURCE[start : SOURCE.index(last, start) + len(last)]


INTO = "else Copy.apply(x)"
OUT_OF = "AllReduce.apply(partial)"
LAYERS = span(INTO, OUT_OF)
CLASSES = span("class Copy(torch.autograd.Function):", "        return grad\n")  # Copy's and AllReduce's
COPY_BACKWARD = "        total = grad.clone(memory_format=torch.contiguous_format)\n        dist.all_reduce(total)\n        return total\n"
REDUCE_SCATTER = (
    "        mine = x.new_empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]))\n"
    "        dist.reduce_scatter_tensor(mine, x.contiguous())\n"
)
GATHER_BACKWARD = (
    "        mine = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))\n"
    "        dist.reduce_scatter_tensor(mine, grad.contiguous())\n"
    "        return mine\n"
)
ALL_REDUCE_FORWARD = "        total = x.clone(memory_format=torch.contiguous_format)\n        dist.all_reduce(total)\n        return total\n"
COLUMN_WEIGHT = "        self.weight = nn.Parameter(full.weight.detach()[mine].clone())\n"
SHARE = "        share = F.cross_entropy(model(x[rows]), y[rows]) / dist.get_world_size()\n"
NORM_PARTS = "        weight, bias = (None if p is None else Copy.apply(p) for p in (norm.weight, norm.bias))\n"
UNEVEN = '        raise ValueError(f"{what}: {total} does not divide by the world size {world_size}")\n'
# Both layers, from the column layer's weight to the row layer's all-reduce.
BOTH_LAYERS = span(COLUMN_WEIGHT, OUT_OF)

MUTANTS = {
    "AllGatherRows gathers into a float32 buffer whatever the rows' dtype": (
        "tp.py",
        "        everyone = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))\n",
        "        everyone = torch.empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))\n",
        lambda folder: check_function(folder, "AllGatherRows"),
        "AllGatherRows raised RuntimeError: ProcessGroupGloo::allgather: invalid tensor type",
    ),
    "the layers use Copy and AllReduce swapped": (
        "tp.py",
        LAYERS,
        LAYERS.replace(INTO, "else AllReduce.apply(x)").replace(OUT_OF, "Copy.apply(partial)"),
        lambda folder: check_collectives(folder, False),
        "the two functions are swapped",
    ),
    "Copy does AllReduce's job and AllReduce Copy's": (
        "tp.py",
        CLASSES,
        CLASSES.replace("class Copy(", "class Swapped(")
        .replace("class AllReduce(", "class Copy(")
        .replace("class Swapped(", "class AllReduce("),
        lambda folder: check_function(folder, "Copy"),
        "are the two swapped?",
    ),
    "the bias added on every rank, before the sum": (
        "tp.py",
        "            out = AllReduce.apply(partial)\n            return out if self.bias is None else out + self.bias\n",
        "            return AllReduce.apply(partial if self.bias is None else partial + self.bias)\n",
        lambda folder: check_forward(folder, 2, False),
        "add the bias once, after the sum",
    ),
    "the bias added on every rank before the reduce-scatter": (
        "tp.py",
        "        out = ReduceScatterRows.apply(partial)\n        return out if self.bias is None else out + Copy.apply(self.bias)\n",
        "        return ReduceScatterRows.apply(partial if self.bias is None else partial + self.bias)\n",
        lambda folder: check_forward(folder, 3, True),
        "add the bias once, after the sum",
    ),
    "a second all-reduce, in AllReduce's backward": (
        "tp.py",
        "        return grad\n",
        "        total = grad.clone()\n        dist.all_reduce(total)\n        return total\n",
        lambda folder: check_collectives(folder, False),
        "RowParallelLinear's backward started 1 all-reduce, expected none (1 all-reduce too many)",
    ),
    "a second all-reduce, in AllReduce's backward, sequence parallel train_step": (
        "tp.py",
        "        return grad\n",
        "        total = grad.clone()\n        dist.all_reduce(total)\n        return total\n",
        lambda folder: check_train_steps(folder, 3, True, steps=1),
        "3 times one process's: a gradient that every rank holds whole was summed over the ranks again",
    ),
    "Copy's backward averages over the ranks": (
        "tp.py",
        COPY_BACKWARD,
        COPY_BACKWARD.replace("        return total", "        return total / dist.get_world_size()"),
        lambda folder: check_backward(folder, 2, True),
        "is 1/2 of one process's, and the same on every rank: the ranks' shares were averaged",
    ),
    "Copy's backward averages over the ranks, alone": (
        "tp.py",
        COPY_BACKWARD,
        COPY_BACKWARD.replace("        return total", "        return total / dist.get_world_size()"),
        lambda folder: check_function(folder, "Copy"),
        "backward returned 1/3 of the sum over the ranks, their mean",
    ),
    "AllReduce sums in place": (
        "tp.py",
        ALL_REDUCE_FORWARD,
        "        dist.all_reduce(x)\n        return x\n",
        lambda folder: check_function(folder, "AllReduce"),
        "AllReduce's forward changed its input x in place: it returns a tensor of its own",
    ),
    "Copy's backward sums in place": (
        "tp.py",
        COPY_BACKWARD,
        "        dist.all_reduce(grad)\n        return grad\n",
        lambda folder: check_function(folder, "Copy"),
        "Copy's backward changed its gradient in place",
    ),
    "sequence parallel, every row run on every rank": (
        "tp.py",
        SHARE,
        SHARE.replace("model(x[rows]), y[rows]", "model(x), y"),
        lambda folder: check_train_steps(folder, 3, True, steps=1),
        "train_step ran the model on 12 rows on rank 0 in a step of 12: sequence parallel, rank r runs its own block"
        " of 4 rows; all 12 on every rank gives the same numbers with 3 times the work",
    ),
    "Copy's backward all-reduces twice": (
        "tp.py",
        COPY_BACKWARD,
        COPY_BACKWARD.replace("        return", "        dist.all_reduce(total)\n        return"),
        lambda folder: check_function(folder, "Copy"),
        "3 times the sum over the ranks: an all-reduce too many",
    ),
    "the input gradient left partial": (
        "tp.py",
        COPY_BACKWARD,
        "        return grad\n",
        lambda folder: check_backward(folder, 2, False),
        "the ranks' input gradients add up to one process's",
    ),
    "every rank holds the first block of the column layer's weight": (
        "tp.py",
        COLUMN_WEIGHT,
        COLUMN_WEIGHT.replace("[mine]", "[: full.out_features // dist.get_world_size()]"),
        lambda folder: check_shards(folder, 2),
        "holds rows [0, 1, 2, 3, 4, 5] of the full 12x7 weight, expected rows 6-11: rank r holds block r",
    ),
    "the column layer's weight rows taken one in W": (
        "tp.py",
        COLUMN_WEIGHT,
        COLUMN_WEIGHT.replace("[mine]", "[dist.get_rank() :: dist.get_world_size()]"),
        lambda folder: check_shards(folder, 3),
        "holds rows [0, 3, 6, 9] of the full 12x7 weight, expected rows 0-3: rank r holds block r, all in one piece",
    ),
    "the row layer's weight split by rows": (
        "tp.py",
        "        self.weight = nn.Parameter(full.weight.detach()[:, mine].clone())\n",
        "        self.weight = nn.Parameter(full.weight.detach()[mine].clone())\n",
        lambda folder: check_shards(folder, 2),
        "expected 5x6: columns 0-5 of the full 5x12 weight",
    ),
    "the column layer's bias not split": (
        "tp.py",
        "nn.Parameter(full.bias.detach()[mine].clone())",
        "nn.Parameter(full.bias.detach().clone())",
        lambda folder: check_shards(folder, 2),
        "expected its block of the full bias",
    ),
    "a reduce-scatter along the features": (
        "tp.py",
        REDUCE_SCATTER,
        "        mine = x.new_empty((x.shape[0], x.shape[1] // dist.get_world_size()))\n"
        "        dist.reduce_scatter(mine, [c.contiguous() for c in x.chunk(dist.get_world_size(), dim=1)])\n",
        lambda folder: check_function(folder, "ReduceScatterRows"),
        "as if split along the features (dim 1): sequence parallelism splits the rows (dim 0)",
    ),
    "the all-gather's backward keeps this rank's rows without summing": (
        "tp.py",
        GATHER_BACKWARD,
        "        size = grad.shape[0] // dist.get_world_size()\n"
        "        return grad[dist.get_rank() * size : (dist.get_rank() + 1) * size]\n",
        lambda folder: check_function(folder, "AllGatherRows"),
        "every rank used these rows, so sum their gradients over the ranks",
    ),
    "the norm's weight and bias used on the rows without Copy": (
        "tp.py",
        "None if p is None else Copy.apply(p) for p",
        "p for p",
        lambda folder: check_backward(folder, 2, True),
        "uses it on its own rows, so its gradient is the sum of the ranks' shares, and no backward summed them",
    ),
    "the row layer's bias used on the rows without Copy": (
        "tp.py",
        "out + Copy.apply(self.bias)",
        "out + self.bias",
        lambda folder: check_backward(folder, 3, True),
        "holds all of layers.1.bias but uses it on its own rows, so its gradient is the sum of the ranks' shares",
    ),
    "the norm's gradients summed when every rank holds all the rows": (
        "tp.py",
        "            return norm(x)\n",
        "            return F.layer_norm(x, norm.normalized_shape, Copy.apply(norm.weight), Copy.apply(norm.bias), norm.eps)\n",
        lambda folder: check_backward(folder, 2, False),
        "2 times one process's: a gradient that every rank holds whole was summed",
    ),
    "a norm without weight and bias passed to Copy": (
        "tp.py",
        NORM_PARTS,
        "        weight, bias = Copy.apply(norm.weight), Copy.apply(norm.bias)\n",
        check_norms,
        "a LayerNorm may have no weight or no bias (None); normalise runs it all the same",
    ),
    "the norm's eps left out": (
        "tp.py",
        "weight, bias, norm.eps)",
        "weight, bias)",
        check_norms,
        "normalise uses the norm's own eps (0.5 for norms.1)",
    ),
    "sequence parallel, each rank's mean loss not divided by W": (
        "tp.py",
        SHARE,
        SHARE.replace(" / dist.get_world_size()", ""),
        lambda folder: check_train_steps(folder, 2, True, steps=1),
        "2 times one process's: each rank's loss is the mean over its own rows",
    ),
    "sequence parallel, train_step returns the rank's share of the loss": (
        "tp.py",
        "        loss = AllReduce.apply(share)",
        "        loss = share",
        lambda folder: check_train_steps(folder, 2, True, steps=1),
        "one process's loss on the batch",
    ),
    "no tanh between blocks": (
        "tp.py",
        "            if k < blocks - 1:\n                x = torch.tanh(x)\n",
        "",
        lambda folder: check_matches_torch(folder, False),
        "output of two blocks differs from torch's parallelize_module",
    ),
    "no error for a size the world size does not divide": (
        "tp.py",
        "    if total % world_size:\n" + UNEVEN,
        "",
        check_uneven,
        "gave no error",
    ),
    "my_block returns a range": (
        "tp.py",
        "    return slice(start, start + total // world_size)\n",
        "    return range(start, start + total // world_size)\n",
        lambda folder: check_shards(folder, 2),
        "my_block(12, 'rows') returned a range: it returns a slice",
    ),
    "an error that does not name what": (
        "tp.py",
        UNEVEN,
        UNEVEN.replace("{what}: ", ""),
        lambda folder: check_shards(folder, 3),
        'names what ("the tests\' width")',
    ),
    "the column layer's weight a view of the full weight": (
        "tp.py",
        COLUMN_WEIGHT,
        COLUMN_WEIGHT.replace("[mine].clone()", "[mine]"),
        lambda folder: check_shards(folder, 2),
        "ColumnParallelLinear.weight use the memory of the full nn.Linear",
    ),
    "an error that does not name the size": (
        "tp.py",
        UNEVEN,
        UNEVEN.replace("{total} does not divide", "it does not divide"),
        check_uneven,
        "names the size",
    ),
    # The column layer cut with torch.chunk (4, 4 and 2 of 10 features): no error from the layer alone.
    "the column layer's block taken with chunk": (
        "tp.py",
        '        mine = my_block(full.out_features, "ColumnParallelLinear\'s out_features")\n' + COLUMN_WEIGHT,
        "        pieces = full.weight.detach().chunk(dist.get_world_size())\n"
        "        mine = slice(sum(map(len, pieces[: dist.get_rank()])), sum(map(len, pieces[: dist.get_rank() + 1])))\n"
        + COLUMN_WEIGHT,
        check_uneven,
        "ColumnParallelLinear of an nn.Linear(7, 10) (its 10 output features) on 3 ranks gave no error",
    ),
    # Issue 36: the check read the error's name as the worker worded it; these two passed.
    "an error of its own class that is named ValueError": (
        "tp.py",
        UNEVEN,
        UNEVEN.replace("raise ValueError(", 'raise type("ValueError", (Exception,), {})('),
        check_uneven,
        "which is not a ValueError",
    ),
    # Issue 47: each rank given only its own block of each layer (the rest: other numbers), as where grades count.
    "every rank keeps the whole layers and computes the whole block alone": (
        "tp.py",
        BOTH_LAYERS,
        BOTH_LAYERS.replace("detach()[mine]", "detach()")
        .replace("detach()[:, mine]", "detach()")
        .replace(OUT_OF, "partial"),
        lambda folder: check_kernel_count(folder, False, 2),
        "rank 0's output is what it computes alone from the whole layers it was given",
    ),
    "the rows refused after a collective": (
        "tp.py",
        '        rows = my_block(len(x), "the batch\'s rows")\n',
        '        dist.barrier()\n        rows = my_block(len(x), "the batch\'s rows")\n',
        check_uneven,
        "after 1 messages or collectives had started",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])


@pytest.mark.parametrize("args, words", [(["--n-layers", "1"], "--n-layers 1: the layers pair up")])
def test_sizes_the_script_cannot_take_are_refused(args, words):
    """The smallest sizes the parser takes, where the model cannot be split so: one line, before any world."""
    assert_refused("tp.py", args, words)


# Issue 47: the sum over the ranks as torch's DTensor makes it (parallelize_module's parameters are DTensors): right
# values, and the kernel's count of DTensor's C++ constructor and dispatch tells.
TORCH_OWN = (
    "tp.py",
    "        total = x.clone(memory_format=torch.contiguous_format)\n"
    "        dist.all_reduce(total)\n"
    "        return total\n",
    "        from torch.distributed.device_mesh import init_device_mesh\n"
    "        from torch.distributed.tensor import DTensor, Partial, Replicate\n"
    "\n"
    '        mesh = init_device_mesh("cpu", (dist.get_world_size(),))\n'
    "        partial = DTensor.from_local(x.contiguous(), mesh, [Partial()], run_check=False)\n"
    "        return partial.redistribute(placements=[Replicate()]).to_local().clone()\n",
    lambda folder: check_forward(folder, 2, False),
    "DTensor",
)


def test_torch_own_dtensor_is_caught(tmp_path, monkeypatch):
    assert_torch_own_caught(tmp_path / "mutant", "the sum as a DTensor's", *TORCH_OWN, monkeypatch)
