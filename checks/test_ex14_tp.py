"""Exercise 14: tensor and sequence parallelism, forward and backward, against one process and torch's."""

import re
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# torch's tensor parallelism, for the comparison's probe: imported here, by the grader, so that the workers it
# forks find it loaded; each worker would otherwise spend 1 to 3 s importing it.
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from checks.comm_log import ALL_GATHER, ALL_REDUCE, KINDS, REDUCE_SCATTER, CommLog
from checks.helpers import (
    Given,
    close,
    computed_with_peers,
    drawn,
    either,
    kernel_counted,
    keyed,
    load,
    many,
    maybe,
    reference_world,
    world,
)
from course.grading.points import said
from course.runtime.compat import cpu_mesh

# Two blocks. Only the hidden width 12 divides by 2 and 3: a layer split along another width fails.
WIDTHS = [7, 12, 5, 12, 5]
BLOCK = WIDTHS[:3]
BLOCKS = len(WIDTHS) // 2
ROWS = 12  # of a batch; sequence parallel, each of 2 or 3 ranks runs a block of them
LR = 0.2
STEPS = 3


def kinds(log):
    return [KINDS.get(name, name) for name in log.summary()["collectives"]]


class Blocks(nn.Module):
    """The tests' model: per block LayerNorm, Linear, tanh, Linear; tanh between blocks. Exercise 1's
    MLP with biases and norms; the same weights wherever it is built. norms: True, False (none), or each
    block's LayerNorm's options (ODD_NORMS)."""

    def __init__(self, widths=WIDTHS, bias=True, norms=True):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(widths, widths[1:]))
        options = [{}] * (len(widths) // 2) if norms is True else norms
        self.norms = nn.ModuleList(nn.LayerNorm(widths[2 * k], **o) for k, o in enumerate(options)) if norms else None
        with torch.no_grad():  # not LayerNorm's ones and zeros: a mistake with them must show
            for norm in self.norms or []:
                for p, low, high in ((norm.weight, 0.5, 1.5), (norm.bias, -0.5, 0.5)):
                    if p is not None:
                        p.uniform_(low, high)

    def forward(self, x):
        pairs = list(zip(self.layers[::2], self.layers[1::2]))
        for k, (up, down) in enumerate(pairs):
            if self.norms is not None:
                x = self.norms[k](x)
            x = down(torch.tanh(up(x)))
            if k + 1 < len(pairs):
                x = torch.tanh(x)
        return x


def data(widths, rows=ROWS, step=0):
    """The batch every rank holds whole: inputs, the gradient of the output, and labels."""
    g = torch.Generator().manual_seed(100 + step)
    return (
        torch.randn(rows, widths[0], generator=g),
        torch.randn(rows, widths[-1], generator=g),
        torch.randint(0, widths[-1], (rows,), generator=g),
    )


def block_of(total, rank, world_size):
    size = total // world_size
    return slice(rank * size, (rank + 1) * size)


def part(name, tensor, rank, world_size):
    """Rank r's part of one process's parameter (or gradient) `name`: a column layer (even place)
    holds a block of the output features, a row layer (odd place) a block of the input features
    and all of the bias, a norm all of itself."""
    kind, place, what = name.split(".")
    if kind == "norms":
        return tensor
    if int(place) % 2 == 0:
        return tensor[block_of(tensor.shape[0], rank, world_size)]
    return tensor if what == "bias" else tensor[:, block_of(tensor.shape[1], rank, world_size)]


def whole_on_every_rank(name, sequence_parallel):
    """Parameters that every rank holds whole and, sequence parallel, uses on its own rows only."""
    return sequence_parallel and (name.startswith("norms.") or (name.endswith("bias") and int(name.split(".")[1]) % 2))


def shape(t):
    return "x".join(map(str, t.shape))


def rows_of(rank, world_size, sequence_parallel, rows=ROWS):
    return block_of(rows, rank, world_size) if sequence_parallel else slice(None)


# The four autograd functions, each alone.

N, D = 2, 6  # rows per rank, features: D divides by 3, so a split along the features has a shape of its own
FUNCTIONS = {  # forward's input rows and backward's gradient rows, in blocks of N, and the collectives each way
    "Copy": (3, 3, [], [ALL_REDUCE]),
    "AllReduce": (3, 3, [ALL_REDUCE], []),
    "AllGatherRows": (1, 3, [ALL_GATHER], [REDUCE_SCATTER]),
    "ReduceScatterRows": (3, 1, [REDUCE_SCATTER], [ALL_GATHER]),
}


def function_data(name, rank):
    """Whole numbers, so that every sum is exact, in float64: what a function makes keeps its input's dtype,
    which float32 everywhere would not show. Copy's input is the same on every rank (it is one process's x);
    every other input and every gradient is the rank's own."""
    x_blocks, g_blocks, _, _ = FUNCTIONS[name]
    g = torch.Generator().manual_seed(10 * rank + (0 if name == "Copy" else 1))
    x = torch.randint(-9, 10, (x_blocks * N, D), generator=torch.Generator().manual_seed(7)).double()
    if name != "Copy":
        x = torch.randint(-9, 10, (x_blocks * N, D), generator=g).double()
    return x, torch.randint(-9, 10, (g_blocks * N, D), generator=g).double()


def function_in_world(folder, name):
    """Probe: one of the four functions forward and backward on this rank's data; what each gave and started."""
    function = getattr(load(folder).tp, name)
    x, grad = function_data(name, dist.get_rank())
    x.requires_grad_()
    given = x.detach().clone(), grad.clone()
    try:
        with CommLog() as forward:
            out = function.apply(x)
        with CommLog() as backward:
            if out.shape == grad.shape and out.dtype == grad.dtype:  # else the judge has the forward's to report
                out.backward(grad)
    except NotImplementedError:
        raise  # a TODO not written yet: the stub says so
    except RuntimeError as error:  # gloo refuses a buffer of another dtype on every rank, before sending
        return {"raised": f"{type(error).__name__}: {str(error)[:160]}"}
    return {
        "out": out.detach(),
        "grad": x.grad,
        "forward": kinds(forward),
        "backward": kinds(backward),
        # whether the forward wrote into its input, and the backward into the gradient it was given
        "wrote": [not torch.equal(x.detach(), given[0]), not torch.equal(grad, given[1])],
    }


def judge_function(name, result, rank, world_size):
    """A function's forward and backward give this rank the sums and blocks of its collectives.

    Each diagnosis is an assert of its own, with its concept: the class report groups the mistakes by it."""
    xs, gs = zip(*(function_data(name, r) for r in range(world_size)))
    mine = block_of(world_size * N, rank, world_size)
    out, grad = result["out"], result["grad"]
    for way, made in (("forward", out), ("backward", grad)):
        assert made is None or made.dtype == torch.float64, said(
            f"{name}'s {way} makes another dtype than it was given",
            f"on rank {rank} of {world_size}, {name}'s {way} returned a {str(made.dtype).removeprefix('torch.')}"
            " tensor for float64 ones: a tensor made for a collective takes the dtype of what it holds (new_empty,"
            " empty_like, or dtype=), whatever the model's dtype",
        )
    expected_out, expected_grad = {
        "Copy": (xs[rank], sum(gs)),
        "AllReduce": (sum(xs), gs[rank]),
        "AllGatherRows": (torch.cat(xs), sum(gs)[mine]),
        "ReduceScatterRows": (sum(xs)[mine], torch.cat(gs)),
    }[name]
    where = f"on rank {rank} of {world_size}, {name}'s"
    if not close(out, expected_out):
        said_shape = f"{where} forward returned a {shape(out)} tensor, expected {shape(expected_out)}"
        along_features = {"AllGatherRows": (N, world_size * D), "ReduceScatterRows": (world_size * N, D // world_size)}
        assert tuple(out.shape) != along_features.get(name), said(
            f"{name} split along the features, not the rows",
            f"{said_shape}, as if split along the features (dim 1): sequence parallelism splits the rows (dim 0)",
        )
        assert out.shape == expected_out.shape, said(f"{name}'s forward of the wrong shape", said_shape)
        assert not (name == "Copy" and close(out, world_size * xs[rank])), said(
            "Copy's forward sums over the ranks",
            f"{where} forward summed x over the ranks: it returns x unchanged (the sum is AllReduce's forward:"
            " are the two swapped?)",
        )
        assert not (name == "AllReduce" and close(out, xs[rank])), said(
            "AllReduce's forward returns x unchanged",
            f"{where} forward returned this rank's x unchanged: it returns the sum over the ranks (returning x is"
            " Copy's forward: are the two swapped?)",
        )
        assert not (name == "ReduceScatterRows" and close(out, xs[rank][mine])), said(
            "ReduceScatterRows keeps its own rows, unsummed",
            f"{where} forward returned this rank's own rows of x: rank {rank}'s block of the sum over the ranks",
        )
        others = [r for r in range(world_size) if r != rank]
        other = next((r for r in others if close(out, sum(xs)[block_of(world_size * N, r, world_size)])), None)
        assert not (name == "ReduceScatterRows" and other is not None), said(
            "ReduceScatterRows keeps another rank's block",
            f"{where} forward returned rank {other}'s block of the sum: rank {rank} keeps block {rank}",
        )
        assert not (name == "AllGatherRows" and sorted(out.tolist()) == sorted(expected_out.tolist())), said(
            "AllGatherRows puts the rows out of rank order",
            f"{where} forward has every rank's rows, in the wrong order: rank 0's first, then rank 1's, ...",
        )
        raise AssertionError(
            said(f"{name}'s forward off", f"{where} forward is off by up to {(out - expected_out).abs().max():.3g}")
        )
    assert grad is not None, said(f"{name}'s backward gives no gradient", f"{where} backward gave x no gradient")
    if close(grad, expected_grad):
        return
    assert grad.shape == expected_grad.shape, said(
        f"{name}'s backward of the wrong shape",
        f"{where} backward returned a {shape(grad)} gradient for a {shape(expected_out)} input",
    )
    assert not close(grad, world_size * expected_grad), said(
        f"an all-reduce too many in {name}'s backward",
        f"{where} backward returned {world_size} times the sum over the ranks: an all-reduce too many",
    )
    assert not close(world_size * grad, expected_grad), said(
        f"{name}'s backward averages over the ranks",
        f"{where} backward returned 1/{world_size} of the sum over the ranks, their mean: the gradient of x is the sum",
    )
    assert not (name == "Copy" and close(grad, gs[rank])), said(
        "Copy's backward does not sum over the ranks",
        f"{where} backward returned this rank's gradient unchanged, which is only its own part: the input gradient"
        " is the sum over the ranks",
    )
    assert not (name == "AllReduce" and close(grad, sum(gs))), said(
        "AllReduce's backward sums again",
        f"{where} backward summed the gradient over the ranks: every rank holds the sum's whole gradient,"
        " which passes to each term unchanged; a second all-reduce counts it W times",
    )
    assert not (name == "AllGatherRows" and close(grad, gs[rank][mine])), said(
        "AllGatherRows' backward does not sum over the ranks",
        f"{where} backward returned this rank's block of its own gradient: every rank used these rows, so sum"
        " their gradients over the ranks",
    )
    raise AssertionError(
        said(
            f"{name}'s backward off",
            f"{where} backward is off by up to {(grad - expected_grad).abs().max():.3g}",
        )
    )


def check_function(folder, name, world_size=3):
    """Each autograd function gives the sums and blocks of its collectives, and starts only its own collective
    each way."""
    expect = {"out": torch.Tensor, "grad": maybe(torch.Tensor), "forward": many(str), "backward": many(str)}
    results = world(function_in_world, world_size, folder, name, expect=either({"raised": str}, expect))
    _, _, forward, backward = FUNCTIONS[name]
    for rank, result in enumerate(results):
        assert "raised" not in result, said(
            f"{name} fails on another dtype than float32",
            f"on rank {rank} of {world_size}, {name} raised {result.get('raised')} on float64 tensors (the other"
            " checks run float32): a tensor made for a collective takes the dtype of what it holds (new_empty,"
            " empty_like, or dtype=), whatever the model's dtype",
        )
        judge_function(name, result, rank, world_size)
        for way, what, wrote in zip(("forward", "backward"), ("input x", "gradient"), result["wrote"]):
            assert not wrote, said(
                f"{name}'s {way} writes into what it was given",
                f"on rank {rank} of {world_size}, {name}'s {way} changed its {what} in place: it returns a tensor"
                f" of its own and leaves its {what} as the caller gave it (autograd, or the caller, may read it"
                " again)",
            )
        for way, expected in (("forward", forward), ("backward", backward)):
            assert result[way] == expected, said(
                f"{name}'s {way} starts other collectives than its own",
                f"{name}'s {way} started {said_list(result[way])}, expected {said_list(expected)}",
            )


@pytest.mark.points(1)
@pytest.mark.parametrize("name", FUNCTIONS)
def test_function(impl_dir, name):
    check_function(impl_dir, name)


# Each rank's blocks of the weights.


BLOCK_TOTALS = (12, 6)  # my_block's sizes, which 2 and 3 ranks divide; 7 divides by neither
REFUSED = (7, "the tests' width")


def shares(tensor, full):
    return tensor.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()


def shards_in_world(folder):
    """Probe: a column and a row layer from full layers, and ParallelMLP: their parameters on this rank, and whose
    memory they use; my_block's slices, and what it raised for a size the world size does not divide."""
    tp = load(folder).tp
    full = Blocks()
    column, row = tp.ColumnParallelLinear(full.layers[0]), tp.RowParallelLinear(full.layers[1])
    model = tp.ParallelMLP(list(full.layers), list(full.norms))
    blocks = []
    for total in BLOCK_TOTALS:
        got = tp.my_block(total, "rows")
        blocks.append([type(got).__name__, *([got.start, got.stop, got.step] if isinstance(got, slice) else [])])
    try:
        tp.my_block(*REFUSED)
        refused = None
    except Exception as error:  # noqa: BLE001 - which error, and its words, are the check's to judge
        refused = f"{type(error).__name__}: {error}"
    layers = ((column, full.layers[0]), (row, full.layers[1]))
    return {
        "column": {n: p.detach() for n, p in column.named_parameters()},
        "row": {n: p.detach() for n, p in row.named_parameters()},
        "model": {n: p.detach() for n, p in model.named_parameters()},
        "shared": [
            f"{type(layer).__name__}.{n}"
            for layer, whole in layers
            for n, p in layer.named_parameters()
            if shares(p, getattr(whole, n))
        ],
        "blocks": blocks,
        "refused": refused,
    }


def judge_my_block(result, rank, world_size):
    """my_block gives rank r block r as a slice, and refuses a size the world size does not divide with a
    ValueError that names what, the size and W."""
    for total, (kind, *got) in zip(BLOCK_TOTALS, result["blocks"]):
        call = f"on rank {rank} of {world_size}, my_block({total}, 'rows') returned"
        assert kind == "slice", said("my_block not a slice", f"{call} a {kind}: it returns a slice")
        block = block_of(total, rank, world_size)
        assert got[:2] == [block.start, block.stop] and got[2] in (None, 1), said(
            "my_block not the rank's block",
            f"{call} slice{tuple(got)}, expected slice({block.start}, {block.stop}): rank r's block of"
            f" block_sizes({total}, {world_size})",
        )
    total, what = REFUSED
    refused = result["refused"]
    assert refused is not None, said(
        "a size the world does not divide accepted",
        f"my_block({total}, {what!r}) on {world_size} ranks gave no error: {world_size} does not divide {total}",
    )
    named = refused.startswith("ValueError") and what in refused
    assert named and re.search(rf"\b{total}\b", refused) and re.search(rf"\b{world_size}\b", refused), said(
        "refused without a ValueError that names what, the size and W",
        f"my_block({total}, {what!r}) on {world_size} ranks raised {refused!r}: expected a ValueError whose message"
        f" names what ({what!r}), the size ({total}) and the world size ({world_size})",
    )


def _which_rows(got, full):
    """The rows of full that got's rows are, as a list (None for a row that is none of them)."""
    return [next((i for i in range(len(full)) if torch.equal(row, full[i])), None) for row in got]


def judge_slice(layer, got, full, rank, world_size):
    """Rank r's weight of a column (layer 0) or row (layer 1) layer is its block of the full weight."""
    by_rows = layer == 0
    expected = part(f"layers.{layer}.weight", full, rank, world_size)
    if torch.equal(got, expected):
        return
    kind = "ColumnParallelLinear" if by_rows else "RowParallelLinear"
    block = block_of(full.shape[0 if by_rows else 1], rank, world_size)
    wanted = f"{'rows' if by_rows else 'columns'} {block.start}-{block.stop - 1}"
    assert got.shape == expected.shape, said(
        f"{kind}.weight of the wrong shape",
        f"rank {rank}'s {kind}.weight is {shape(got)}, expected {shape(expected)}: {wanted} of the full"
        f" {shape(full)} weight",
    )
    found = _which_rows(got, full) if by_rows else _which_rows(got.T, full.T)
    assert None in found, said(
        f"{kind}.weight holds another block than the rank's",
        f"rank {rank}'s {kind}.weight holds {'rows' if by_rows else 'columns'} {found} of the full {shape(full)}"
        f" weight, expected {wanted}: rank r holds block r, all in one piece",
    )
    raise AssertionError(
        said(
            f"{kind}.weight not a block of the full weight",
            f"rank {rank}'s {kind}.weight holds other numbers than {wanted} of the full weight",
        )
    )


def check_shards(folder, world_size):
    """Each rank holds its part of every parameter: the column layer's block of rows and of the bias, the row
    layer's block of columns and all of the bias, under the full model's names, in new parameters; my_block's
    slices and its refusal."""
    expect = dict.fromkeys(("column", "row", "model"), keyed(torch.Tensor))
    expect |= {"shared": many(str), "blocks": many(many(object), len(BLOCK_TOTALS)), "refused": maybe(str)}
    results = world(shards_in_world, world_size, folder, expect=expect)
    full = Blocks()
    names = [n for n, _ in full.named_parameters()]
    for rank, result in enumerate(results):
        judge_my_block(result, rank, world_size)
        assert not result["shared"], said(
            "a layer's parameters in the full layer's memory",
            f"on rank {rank}, {', '.join(result['shared'])} use the memory of the full nn.Linear they were made from:"
            " the layers hold new parameters (an optimizer step on one would change the other)",
        )
        for layer, kind in ((0, "column"), (1, "row")):
            held = result[kind]
            assert sorted(held) == ["bias", "weight"], said(
                "a layer's parameters not nn.Linear's weight and bias",
                f"{kind} layer's parameters on rank {rank} are {sorted(held)}: expected weight and bias, as nn.Linear's",
            )
            judge_slice(layer, held["weight"], full.layers[layer].weight.detach(), rank, world_size)
        column_bias = part("layers.0.bias", full.layers[0].bias.detach(), rank, world_size)
        assert close(result["column"]["bias"], column_bias), said(
            "ColumnParallelLinear.bias not the rank's block",
            f"rank {rank}'s ColumnParallelLinear.bias is {shape(result['column']['bias'])}, expected its block of"
            f" the full bias, {shape(column_bias)}: the bias of the output features the rank computes",
        )
        assert close(result["row"]["bias"], full.layers[1].bias.detach()), said(
            "RowParallelLinear.bias not whole",
            f"rank {rank}'s RowParallelLinear.bias is {shape(result['row']['bias'])}, expected all of the full"
            f" bias ({len(full.layers[1].bias)}): it is added once, to the sum of the ranks' partial products",
        )
        assert sorted(result["model"]) == sorted(names), said(
            "ParallelMLP's parameters not named as the full model's",
            f"ParallelMLP's parameters on rank {rank} are named {sorted(result['model'])}: expected the full model's"
            f" names, {sorted(names)} (self.layers and self.norms)",
        )
        for name, p in full.named_parameters():
            expected = part(name, p.detach(), rank, world_size)
            assert close(result["model"][name], expected), said(
                "a ParallelMLP parameter not the rank's part",
                f"ParallelMLP's {name} on rank {rank} is {shape(result['model'][name])}, expected rank {rank}'s"
                f" part of the full model's {shape(p)}, {shape(expected)}",
            )


@pytest.mark.points(1)
@pytest.mark.parametrize("world_size", [2, 3])
def test_shards(impl_dir, world_size):
    check_shards(impl_dir, world_size)


# One block, forward and backward, against one process.


def model_in_world(folder, widths, sequence_parallel, norms=True):
    """Probe: ParallelMLP of the tests' model, forward on this rank's rows and backward from the batch's
    output gradient; the output, the input gradient and the parameters' gradients on this rank."""
    tp = load(folder).tp
    full = Blocks(widths, norms=norms)
    model = tp.ParallelMLP(list(full.layers), list(full.norms), sequence_parallel)
    x, grad, _ = data(widths)
    mine = rows_of(dist.get_rank(), dist.get_world_size(), sequence_parallel)
    x = x[mine].clone().requires_grad_()
    out = model(x)
    out.backward(grad[mine])
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "grads": {n: p.grad for n, p in model.named_parameters()},
    }


# What model_in_world and torch_in_world return.
GRADIENTS = {"out": torch.Tensor, "x_grad": maybe(torch.Tensor), "grads": keyed(maybe(torch.Tensor))}


def one_process(widths, norms=True):
    """The judge's run: the tests' model on the whole batch; its output and every gradient."""
    full = Blocks(widths, norms=norms)
    x, grad, _ = data(widths)
    x.requires_grad_()
    out = full(x)
    out.backward(grad)
    return full, x.detach(), out.detach(), x.grad, {n: p.grad for n, p in full.named_parameters()}


def _partial(full, x, rank, world_size, scale=1.0):
    """One block's output on rank r when nothing sums the ranks' partial products (the input times scale)."""
    column, row = full.layers[0], full.layers[1]
    mine = block_of(column.out_features, rank, world_size)
    hidden = torch.tanh(F.linear(full.norms[0](x) * scale, column.weight[mine], column.bias[mine]))
    return F.linear(hidden, row.weight[:, mine]).detach()


def judge_output(full, x, got, expected, rank, world_size, sequence_parallel):
    """Rank r's output of one block is one process's: its own block of the rows, sequence parallel."""
    what = f"{'sequence' if sequence_parallel else 'tensor'} parallel, one block on {world_size} ranks: rank {rank}'s"
    rows = rows_of(rank, world_size, sequence_parallel)
    if close(got, expected[rows]):
        return
    said_shape = f"{what} output is {shape(got)}, expected {shape(expected[rows])}"
    assert not (sequence_parallel and got.shape == expected.shape), said(
        "every row on every rank, sequence parallel",
        f"{said_shape}: every row; sequence parallel, each rank ends with its own block of the rows",
    )
    assert got.shape == expected[rows].shape, said("a block's output of the wrong shape", said_shape)
    bias = full.layers[1].bias.detach()
    assert not close(got, expected[rows] + (world_size - 1) * bias), said(
        "the row layer's bias added on every rank",
        f"{what} output is one process's with the row layer's bias counted {world_size - 1} extra"
        f" time{'s' if world_size > 2 else ''}: every rank added it to its partial product before the sum; add the"
        " bias once, after the sum",
    )
    with torch.no_grad():
        partial, swapped = (_partial(full, x, rank, world_size, scale)[rows] for scale in (1, world_size))
    assert not any(close(got, partial + plus * bias) for plus in (0, 1)), said(
        "the ranks' partial products not summed",
        f"{what} output is its own partial product: the row layer must sum the ranks' partial products",
    )
    assert not any(close(got, swapped + plus * bias) for plus in (0, 1)), said(
        "Copy and AllReduce swapped in the layers",
        f"{what} output is the partial product of an input summed over the ranks: the column layer summed its"
        " input and the row layer did not sum its output. Are Copy and AllReduce swapped?",
    )
    other = next((r for r in range(world_size) if close(got, expected[rows_of(r, world_size, True)])), None)
    assert not sequence_parallel or other is None, said(
        "another rank's block of rows",
        f"{what} output is that of rank {other}'s rows: rank r's block of the rows is block r",
    )
    raise AssertionError(
        said(
            "a block's output not one process's",
            f"{what} output differs from one process's by up to {(got - expected[rows]).abs().max():.3g}",
        )
    )


def check_forward(folder, world_size, sequence_parallel):
    """One block, tensor or sequence parallel, gives every rank its part of one process's output."""
    results = world(model_in_world, world_size, folder, BLOCK, sequence_parallel, expect=GRADIENTS)
    full, x, expected, _, _ = one_process(BLOCK)
    for rank, result in enumerate(results):
        judge_output(full, x, result["out"], expected, rank, world_size, sequence_parallel)


PARALLEL = {"tensor": False, "sequence": True}


# Each parallelism on 2 ranks (2 points) and 3 (1 point).
CASES = [
    pytest.param(parallel, world_size, marks=pytest.mark.points({2: 2, 3: 1}[world_size]))
    for parallel in PARALLEL
    for world_size in (2, 3)
]


@pytest.mark.parametrize("parallel, world_size", CASES)
def test_forward(impl_dir, parallel, world_size):
    check_forward(impl_dir, world_size, PARALLEL[parallel])


def judge_gradient(what, name, results, rank, expected, world_size, sequence_parallel, loss_undivided=False):
    """Rank r's gradient of `name` (None: of its input) is its part of one process's, `expected`.
    loss_undivided: train_step returned W times one process's loss (each rank's mean loss not divided by W)."""
    grads = [r["x_grad"] if name is None else r["grads"].get(name) for r in results]
    got = grads[rank]
    whose = f"{what}: rank {rank}'s {'input gradient' if name is None else f'gradient of {name}'}"
    assert got is not None, said("a gradient missing", f"{whose} is missing")
    if close(got, expected):
        return
    assert got.shape == expected.shape, said(
        "a gradient of the wrong shape", f"{whose} is {shape(got)}, expected {shape(expected)}"
    )
    scaled = close(got, world_size * expected)
    assert not (scaled and loss_undivided and sequence_parallel), said(
        "the ranks' mean losses not divided by the world size",
        f"{whose} is {world_size} times one process's: each rank's loss is the mean over its own rows, and one"
        f" process's loss the mean over all of them, which is the sum of the ranks' means divided by {world_size}",
    )
    assert not scaled, said(
        "an all-reduce too many in a backward",
        f"{whose} is {world_size} times one process's: a gradient that every rank holds whole was summed over the"
        " ranks again (an all-reduce too many in a backward)",
    )
    same = all(g is not None and close(g, got) for g in grads)
    assert not (same and close(world_size * got, expected)), said(
        "gradients averaged over the ranks, not summed",
        f"{whose} is 1/{world_size} of one process's, and the same on every rank: the ranks' shares were"
        f" averaged (summed, then divided by {world_size}) where one process's gradient is their sum",
    )
    parts = all(g is not None and g.shape == got.shape for g in grads) and close(sum(grads), expected)
    assert not (parts and name is None), said(
        "the input gradient not summed over the ranks",
        f"{whose} is only its own part: the ranks' input gradients add up to one process's. The column layer's"
        " input gradient is the sum over the ranks (Copy's backward)",
    )
    assert not (parts and whole_on_every_rank(name, sequence_parallel)), said(
        "a replicated parameter's gradient not summed over the ranks' rows",
        f"{whose} is only its own rows' share: the ranks' gradients add up to one process's. Every rank holds all"
        f" of {name} but uses it on its own rows, so its gradient is the sum of the ranks' shares, and no backward"
        " summed them",
    )
    assert not parts, said(
        "a gradient only the rank's own part",
        f"{whose} is only its own part: the ranks' gradients add up to one process's",
    )
    raise AssertionError(
        said(
            "a gradient not one process's",
            f"{whose} differs from one process's by up to {(got - expected).abs().max():.3g}",
        )
    )


def check_backward(folder, world_size, sequence_parallel):
    """One block, tensor or sequence parallel, gives every rank its part of one process's gradients."""
    results = world(model_in_world, world_size, folder, BLOCK, sequence_parallel, expect=GRADIENTS)
    _, _, _, x_grad, grads = one_process(BLOCK)
    what = f"{'sequence' if sequence_parallel else 'tensor'} parallel, one block on {world_size} ranks"
    for rank in range(world_size):
        expected = x_grad[rows_of(rank, world_size, sequence_parallel)]
        judge_gradient(what, None, results, rank, expected, world_size, sequence_parallel)
    for name, grad in grads.items():
        for rank in range(world_size):
            expected = part(name, grad, rank, world_size)
            judge_gradient(what, name, results, rank, expected, world_size, sequence_parallel)


@pytest.mark.parametrize("parallel, world_size", CASES)
def test_backward(impl_dir, parallel, world_size):
    check_backward(impl_dir, world_size, PARALLEL[parallel])


# LayerNorms of other kinds: normalise takes any.

# Block 0's norm without a weight or a bias, block 1's with a weight, no bias, and an eps of its own: a
# normalise that passes None to Copy fails on either, one that leaves out eps computes another output.
ODD_NORMS = [dict(elementwise_affine=False), dict(bias=False, eps=0.5)]
ODD_SAID = "LayerNorm(7, elementwise_affine=False) and LayerNorm(5, bias=False, eps=0.5)"


def odd_norms_in_world(folder):
    """Probe: model_in_world of two blocks whose norms are ODD_NORMS, tensor and sequence parallel; what each
    gave, or the error it raised."""
    found = {}
    for parallel, sequence_parallel in PARALLEL.items():
        try:
            found[parallel] = model_in_world(folder, WIDTHS, sequence_parallel, ODD_NORMS)
        except NotImplementedError:  # a stub: the grade says which, as for every check
            raise
        except Exception as error:  # noqa: BLE001 - what it raised is the fact to report
            found[parallel] = {"error": f"{type(error).__name__}: {error}"}
    return found


def check_norms(folder, world_size=2):
    """normalise runs any LayerNorm, one without a weight and a bias, one with an eps of its own: the outputs and
    gradients of one process, tensor and sequence parallel."""
    results = world(
        odd_norms_in_world, world_size, folder, expect=dict.fromkeys(PARALLEL, either({"error": str}, GRADIENTS))
    )
    _, _, expected, x_grad, grads = one_process(WIDTHS, ODD_NORMS)
    default_eps = one_process(WIDTHS, [dict(o, eps=1e-5) for o in ODD_NORMS])[2]
    for parallel, sequence_parallel in PARALLEL.items():
        what = f"{parallel} parallel on {world_size} ranks, with the norms {ODD_SAID}"
        mine = [r[parallel] for r in results]
        for rank, result in enumerate(mine):
            assert "error" not in result, said(
                "normalise fails on a LayerNorm without weight or bias",
                f"{what}: rank {rank}'s forward raised {result['error'][:200]}: a LayerNorm may have no weight or no"
                " bias (None); normalise runs it all the same, with what it has",
            )
            rows = rows_of(rank, world_size, sequence_parallel)
            assert not (not close(result["out"], expected[rows]) and close(result["out"], default_eps[rows])), said(
                "normalise leaves out the norm's eps",
                f"{what}: rank {rank}'s output is that of norms with F.layer_norm's default eps (1e-05): normalise"
                " uses the norm's own eps (0.5 for norms.1)",
            )
            assert close(result["out"], expected[rows]), said(
                "an output not one process's",
                f"{what}: rank {rank}'s output differs from one process's by up to"
                f" {(result['out'] - expected[rows]).abs().max():.3g}",
            )
        for rank in range(world_size):
            judge_gradient(
                what,
                None,
                mine,
                rank,
                x_grad[rows_of(rank, world_size, sequence_parallel)],
                world_size,
                sequence_parallel,
            )
            for name, grad in grads.items():
                judge_gradient(
                    what, name, mine, rank, part(name, grad, rank, world_size), world_size, sequence_parallel
                )


@pytest.mark.points(1)
def test_norms(impl_dir):
    check_norms(impl_dir)


# The collectives, per layer and per block.


def collectives_in_world(folder, sequence_parallel):
    """Probe: the collectives that a column layer, a row layer and ParallelMLP's two blocks start, each
    way (no biases and no norms: those add none tensor parallel, and are checked by their gradients)."""
    tp = load(folder).tp
    full = Blocks(bias=False, norms=False)
    rows = ROWS // dist.get_world_size() if sequence_parallel else ROWS
    hidden = WIDTHS[1] // dist.get_world_size()
    found = {}
    for what, module, x in (
        (
            "ColumnParallelLinear",
            tp.ColumnParallelLinear(full.layers[0], sequence_parallel),
            torch.randn(rows, WIDTHS[0]),
        ),
        ("RowParallelLinear", tp.RowParallelLinear(full.layers[1], sequence_parallel), torch.randn(ROWS, hidden)),
        ("ParallelMLP", tp.ParallelMLP(list(full.layers), None, sequence_parallel), torch.randn(rows, WIDTHS[0])),
    ):
        x.requires_grad_()
        with CommLog() as forward:
            out = module(x)
        with CommLog() as backward:
            out.backward(torch.ones_like(out))
        found[what] = {"forward": kinds(forward), "backward": kinds(backward)}
    return found


def expected_collectives(sequence_parallel, blocks=BLOCKS):
    into, out = ([ALL_GATHER], [REDUCE_SCATTER]) if sequence_parallel else ([], [ALL_REDUCE])
    back_into, back_out = ([REDUCE_SCATTER], [ALL_GATHER]) if sequence_parallel else ([ALL_REDUCE], [])
    return {
        "ColumnParallelLinear": {"forward": into, "backward": back_into},
        "RowParallelLinear": {"forward": out, "backward": back_out},
        "ParallelMLP": {"forward": (into + out) * blocks, "backward": (back_out + back_into) * blocks},
    }


def judge_counts(what, way, got, expected):
    """One way of one module starts the collectives of its functions, in their order."""
    if got == expected:
        return
    extra, missing = Counter(got) - Counter(expected), Counter(expected) - Counter(got)
    started = f"{what}'s {way} started {said_list(got)}, expected {said_list(expected)}"
    told = [f"{n} {kind}{'s' if n > 1 else ''} too many" for kind, n in extra.items()]
    told += [f"{n} {kind}{'s' if n > 1 else ''} missing" for kind, n in missing.items()]
    assert not (extra and what != "ParallelMLP" and way == "backward"), said(
        "a layer's backward starts more than its conjugate's collective",
        f"{started} ({', '.join(told)}): the backward of each function starts the one collective of its conjugate,"
        " and no other",
    )
    assert not extra, said("collectives too many", f"{started} ({', '.join(told)})")
    assert not missing, said("collectives missing", f"{started} ({', '.join(told)})")
    raise AssertionError(said("collectives in another order", f"{started}: the same collectives in another order"))


def said_list(collectives):
    counted = Counter(collectives)
    return ", ".join(f"{n} {kind}{'s' if n > 1 else ''}" for kind, n in counted.items()) or "none"


# A block wide enough that its exchanges dwarf what a world's network carries for nothing (its barriers and
# checks, a few kB): the kernel's count of them bounds what no worker can write.
WIDE, WIDE_ROWS = 128, 256


def wide_block(world_size, sequence_parallel):
    """The wide block's layers (no biases, as in collectives_in_world: only the exchanges decide its output) and
    input, drawn (drawn()), and what each rank is given of them: the input (every row, or this rank's block of
    the rows), and of each weight this rank's block only, the rest of it other numbers drawn for this rank
    alone. A rank can compute its output only with what its peers hold; one that computes from the whole
    layers it was given computes another block."""
    generator = drawn(1400)
    block = {
        "up_weight": torch.randn(WIDE, WIDE, generator=generator) / WIDE**0.5,
        "down_weight": torch.randn(WIDE, WIDE, generator=generator) / WIDE**0.5,
        "x": torch.randn(WIDE_ROWS, WIDE, generator=generator),
    }

    def given(block):
        parts = []
        for rank in range(world_size):
            own = {name: tensor.clone() for name, tensor in block.items()}
            other, features = drawn(1401 + rank), block_of(WIDE, rank, world_size)
            own["up_weight"] = torch.randn(WIDE, WIDE, generator=other) / WIDE**0.5
            own["up_weight"][features] = block["up_weight"][features]
            own["down_weight"] = torch.randn(WIDE, WIDE, generator=other) / WIDE**0.5
            own["down_weight"][:, features] = block["down_weight"][:, features]
            if sequence_parallel:
                own["x"] = block["x"][rows_of(rank, world_size, True, WIDE_ROWS)]
            parts.append((own,))
        return parts

    return Given(lambda: block, given)


def wide_block_in_world(folder, sequence_parallel, given):
    """Probe: a column layer then a row layer of WIDE features made from what this rank was given (wide_block),
    forward and backward on its rows; its output and its input's gradient."""
    tp = load(folder).tp
    up, down = nn.Linear(WIDE, WIDE, bias=False), nn.Linear(WIDE, WIDE, bias=False)
    with torch.no_grad():
        up.weight.copy_(given["up_weight"])
        down.weight.copy_(given["down_weight"])
    x = given["x"].clone().requires_grad_()
    out = tp.RowParallelLinear(down, sequence_parallel)(torch.tanh(tp.ColumnParallelLinear(up, sequence_parallel)(x)))
    out.backward(torch.ones_like(out))
    return {"out": out.detach(), "grad": x.grad}


def _wide_forward(block, x):
    """One process's block: out, and x's gradient of out's sum."""
    x = x.clone().requires_grad_()
    out = F.linear(torch.tanh(F.linear(x, block["up_weight"])), block["down_weight"])
    out.sum().backward()
    return out.detach(), x.grad


def check_kernel_count(folder, sequence_parallel, world_size):
    """Each rank given its own block of the layers only, the block's output and input gradient are one
    process's, and the kernel counted at least the bytes of the block's exchanges in that call: a block that
    computes the whole layer on every rank fails, whatever the communication log says; so does one that gets
    its peers' blocks' contributions but not over the world's network."""
    given = wide_block(world_size, sequence_parallel)
    expect = {"out": torch.Tensor, "grad": maybe(torch.Tensor)}
    observed = world(
        wide_block_in_world, world_size, folder, sequence_parallel, expect=expect, observe=True, per_rank=given
    )
    what = f"a column layer then a row layer of {WIDE} features on {WIDE_ROWS} rows, forward and backward, on {world_size} ranks"
    out, grad = _wide_forward(given.value, given.value["x"])
    way = "sequence" if sequence_parallel else "tensor"
    found = []
    for rank, (result, (own,)) in enumerate(zip(observed.results, given.parts)):
        rows = rows_of(rank, world_size, sequence_parallel, WIDE_ROWS)
        alone = _wide_forward(own, own["x"])  # what the rank computes from the whole layers it was given
        found += [
            (rank, "output", result["out"], out[rows], alone[0]),
            (rank, "input's gradient", result["grad"], grad[rows], alone[1]),
        ]
    computed_with_peers(
        found,
        f"{way} parallel, {what}, each rank given only its own block of each weight (the rest: other numbers)",
        (
            "a parallel layer that computes the whole layer itself",
            "the whole layers it was given",
            "A rank multiplies by its own block only; what the other blocks contribute comes from the other ranks,"
            " by the layers' collectives",
        ),
        "a parallel layer wrong when each rank holds only its block",
    )
    # In either way of splitting, the block's exchanges reach every rank with what the others hold of its input
    # (rows x WIDE) and of its output (rows x WIDE): at least (W - 1) times each, in float32, over the world.
    least = (world_size - 1) * WIDE_ROWS * 2 * WIDE * 4
    kernel_counted(
        observed,
        least,
        "a parallel layer that exchanges nothing",
        what,
        "their collectives, had the layers exchanged their outputs, carry",
    )


def check_collectives(folder, sequence_parallel, world_size=2):
    """The column layer, the row layer and ParallelMLP start the collectives of their functions, each way, and
    the world's network carries them (check_kernel_count)."""
    ways = {"forward": many(str), "backward": many(str)}
    modules = ("ColumnParallelLinear", "RowParallelLinear", "ParallelMLP")
    results = world(collectives_in_world, world_size, folder, sequence_parallel, expect=dict.fromkeys(modules, ways))
    expected = expected_collectives(sequence_parallel)
    column, row = expected["ColumnParallelLinear"], expected["RowParallelLinear"]
    for rank, found in enumerate(results):
        swapped = found["ColumnParallelLinear"] == row and found["RowParallelLinear"] == column
        assert not swapped, said(
            "the column and row layers' functions swapped",
            f"on rank {rank}, ColumnParallelLinear started the row layer's collectives ({said_list(row['forward'])}"
            f" forward, {said_list(row['backward'])} backward) and RowParallelLinear the column layer's: the two"
            f" functions are swapped. The column layer's input goes into the parallel region"
            f" ({'AllGatherRows' if sequence_parallel else 'Copy'}), the row layer's output comes out of it"
            f" ({'ReduceScatterRows' if sequence_parallel else 'AllReduce'})",
        )
        for what in ("ColumnParallelLinear", "RowParallelLinear", "ParallelMLP"):
            for way in ("forward", "backward"):
                where = f"{'sequence' if sequence_parallel else 'tensor'} parallel, rank {rank}: {what}"
                judge_counts(where, way, found[what][way], expected[what][way])
    check_kernel_count(folder, sequence_parallel, world_size)


@pytest.mark.points(2)
@pytest.mark.parametrize("parallel", PARALLEL)
def test_collectives(impl_dir, parallel):
    check_collectives(impl_dir, PARALLEL[parallel])


# Training steps.


def train_in_world(folder, sequence_parallel, steps):
    """Probe: train_step on ParallelMLP of the tests' model, `steps` batches; the losses it returned, the
    gradients of the first step and this rank's parameters after each step."""
    tp = load(folder).tp
    full = Blocks()
    model = tp.ParallelMLP(list(full.layers), list(full.norms), sequence_parallel)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rows = []  # the rows of each forward of the model in the first step, as the tests' hook saw them
    hook = model.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0] if args else None))
    losses, history, grads = [], [], None
    for step in range(steps):
        x, _, y = data(WIDTHS, step=step)
        losses.append(tp.train_step(model, optimizer, x, y))
        if step == 0:
            grads = {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}
            hook.remove()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"losses": losses, "grads": grads, "history": history, "rows": rows}


def check_train_steps(folder, world_size, sequence_parallel, steps=STEPS):
    """train_step returns one process's loss on every rank, and its steps leave each rank its part of one
    process's parameters."""
    expect = {
        "losses": many(object, steps),
        "grads": keyed(maybe(torch.Tensor)),
        "history": many(keyed(torch.Tensor), steps),
    }
    results = world(train_in_world, world_size, folder, sequence_parallel, steps, expect=expect)
    full = Blocks()
    optimizer = torch.optim.SGD(full.parameters(), lr=LR)
    what = f"{'sequence' if sequence_parallel else 'tensor'} parallel on {world_size} ranks"
    for step in range(steps):
        x, _, y = data(WIDTHS, step=step)
        optimizer.zero_grad()
        loss = F.cross_entropy(full(x), y)
        loss.backward()
        if step == 0:
            for rank, result in enumerate(results):
                judge_rows(what, result["rows"], rank, world_size, sequence_parallel)
            undivided = all(
                isinstance(r["losses"][0], float) and close(torch.tensor(r["losses"][0]), world_size * loss.detach())
                for r in results
            )
            for name, p in full.named_parameters():
                for rank in range(world_size):
                    expected = part(name, p.grad, rank, world_size)
                    judge_gradient(
                        f"{what}, train_step", name, results, rank, expected, world_size, sequence_parallel, undivided
                    )
        optimizer.step()
        for rank, result in enumerate(results):
            got = result["losses"][step]
            shown = f"{got:.6f}" if isinstance(got, float) else repr(got)
            assert isinstance(got, float) and abs(got - loss.item()) <= 1e-5 * max(1.0, abs(loss.item())), said(
                "train_step's loss not one process's",
                f"{what}, train_step returned {shown} on rank {rank} in step {step}: one process's loss on the"
                f" batch is {loss.item():.6f}, the mean over all its rows, and every rank returns it",
            )
            for name, p in full.named_parameters():
                expected = part(name, p.detach(), rank, world_size)
                assert close(result["history"][step][name], expected), said(
                    "parameters after a step not the rank's part of one process's",
                    f"{what}, after step {step}, rank {rank}'s {name} differs from its part of one process's",
                )


def judge_rows(what, rows, rank, world_size, sequence_parallel):
    """train_step runs the model once a step, on every row tensor parallel, on the rank's block sequence parallel."""
    expected = ROWS // world_size if sequence_parallel else ROWS
    assert rows == [expected], said(
        "every row on every rank, sequence parallel" if sequence_parallel and rows == [ROWS] else "the rows run",
        f"{what}, train_step ran the model on {' and '.join(map(str, rows)) or 'no'} rows on rank {rank} in a"
        f" step of {ROWS}: "
        + (
            f"sequence parallel, rank r runs its own block of {expected} rows; all {ROWS} on every rank gives the"
            f" same numbers with {world_size} times the work"
            if sequence_parallel
            else f"tensor parallel, every rank runs all {ROWS} rows, once"
        ),
    )


@pytest.mark.points(2)
@pytest.mark.parametrize("parallel", PARALLEL)
def test_train_steps(impl_dir, parallel):
    check_train_steps(impl_dir, 3 if PARALLEL[parallel] else 2, PARALLEL[parallel])


# The same as torch's parallelize_module.


def torch_in_world(sequence_parallel):
    """Probe, no student code: torch's tensor parallelism of the tests' model, as model_in_world runs it."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    full = Blocks()
    plan = {}
    for k in range(len(full.norms)):
        if sequence_parallel:
            plan[f"norms.{k}"] = SequenceParallel(sequence_dim=0)
            plan[f"layers.{2 * k}"] = ColwiseParallel(input_layouts=Shard(0))
            plan[f"layers.{2 * k + 1}"] = RowwiseParallel(output_layouts=Shard(0))
        else:
            plan[f"layers.{2 * k}"] = ColwiseParallel()
            plan[f"layers.{2 * k + 1}"] = RowwiseParallel()
    model = parallelize_module(full, cpu_mesh(), plan)
    x, grad, _ = data(WIDTHS)
    mine = rows_of(rank, world_size, sequence_parallel)
    x = x[mine].clone().requires_grad_()
    out = model(x)
    out.backward(grad[mine])
    return {
        "out": out.detach().clone(),
        "x_grad": x.grad,
        "grads": {n: local(p.grad) for n, p in model.named_parameters()},
    }


def local(grad):
    """This rank's part of a gradient of torch's tensor parallelism. SequenceParallel leaves the norms'
    gradients as Partial(sum): each rank's rows' share, summed when something reads them."""
    if not isinstance(grad, DTensor):
        return grad
    if any(isinstance(p, Partial) for p in grad.placements):
        grad = grad.redistribute(placements=[Replicate()])
    return grad.to_local()


def check_matches_torch(folder, sequence_parallel, world_size=2):
    """ParallelMLP gives each rank the output and gradients of torch's parallelize_module."""
    mine = world(model_in_world, world_size, folder, WIDTHS, sequence_parallel, expect=GRADIENTS)
    theirs = reference_world(torch_in_world, world_size, sequence_parallel, expect=GRADIENTS)
    plan = (
        "SequenceParallel, ColwiseParallel and RowwiseParallel on rows"
        if sequence_parallel
        else "ColwiseParallel and RowwiseParallel"
    )
    for rank, (got, expected) in enumerate(zip(mine, theirs)):
        assert close(got["out"], expected["out"]), said(
            "an output not torch's parallelize_module's",
            f"rank {rank}'s output of two blocks differs from torch's parallelize_module with {plan}",
        )
        assert got["x_grad"] is not None and close(got["x_grad"], expected["x_grad"]), said(
            "the input gradient not torch's parallelize_module's",
            f"rank {rank}'s input gradient differs from torch's parallelize_module with {plan}",
        )
        for name, grad in expected["grads"].items():
            assert got["grads"].get(name) is not None and close(got["grads"][name], grad), said(
                "a parameter's gradient not torch's parallelize_module's",
                f"rank {rank}'s gradient of {name} differs from torch's parallelize_module with {plan}",
            )


@pytest.mark.points(1)
@pytest.mark.parametrize("parallel", PARALLEL)
def test_matches_torch(impl_dir, parallel):
    check_matches_torch(impl_dir, PARALLEL[parallel])


# Sizes the world size does not divide.


def uneven_in_world(folder):
    """Probe: a hidden width of 10, a batch of 8 rows sequence parallel, and each layer alone with 10 features to
    split, on 3 ranks: what each raised, as facts the probe took itself (whether it is a ValueError, its words, and
    the messages and collectives started before it), None where it raised nothing."""
    tp = load(folder).tp
    raised = []
    for attempt in (
        lambda: tp.ParallelMLP(list(Blocks([7, 10, 5]).layers)),
        lambda: tp.ColumnParallelLinear(nn.Linear(7, 10)),
        lambda: tp.RowParallelLinear(nn.Linear(10, 5)),
        lambda: tp.train_step(
            (model := tp.ParallelMLP(list(Blocks().layers), None, True)),
            torch.optim.SGD(model.parameters(), lr=LR),
            *data(WIDTHS, rows=8)[::2],
        ),
    ):
        fact = None
        with CommLog() as log:
            try:
                attempt()
            except NotImplementedError:  # a stub: the grade says which, as for every check
                raise
            except Exception as error:  # noqa: BLE001 - which error, and where, are the check's to judge
                fact = {"value_error": isinstance(error, ValueError), "name": type(error).__name__, "words": str(error)}
        raised.append(fact and fact | {"started": len(log.started())})
    return raised


def check_uneven(folder, world_size=3):
    """A width or a batch that the world size does not divide is refused before any message or collective, with a
    ValueError naming both. What pays is what the probe saw of the error (its class, when it came), not its name
    as the submission may word it (a class of its own named ValueError, say)."""
    fact = maybe({"value_error": bool, "name": str, "words": str, "started": int})
    width, column, row, rows = world(uneven_in_world, world_size, folder, expect=(fact,) * 4)[0]
    for what, size, got in (
        ("a hidden width of 10", 10, width),
        ("ColumnParallelLinear of an nn.Linear(7, 10) (its 10 output features)", 10, column),
        ("RowParallelLinear of an nn.Linear(10, 5) (its 10 input features)", 10, row),
        ("a batch of 8 rows, sequence parallel", 8, rows),
    ):
        assert got is not None, said(
            "a size the world does not divide accepted",
            f"{what} on {world_size} ranks gave no error: {world_size} does not divide {size}",
        )
        words = f"{got['name']}: {got['words']}"
        assert got["value_error"], said(
            "refused without a ValueError",
            f"{what} on {world_size} ranks raised {words!r}, which is not a ValueError (its class does not derive"
            " from ValueError): refuse the size with a ValueError",
        )
        assert re.search(rf"\b{size}\b", words) and re.search(rf"\b{world_size}\b", words), said(
            "refused without a ValueError that names the sizes",
            f"{what} on {world_size} ranks raised {words!r}: expected a ValueError whose message names the size"
            f" ({size}) and the world size ({world_size})",
        )
        assert got["started"] == 0, said(
            "a size the world does not divide refused after messages started",
            f"{what} on {world_size} ranks raised its ValueError after {got['started']} messages or collectives had"
            " started: refuse the size before any, where the size is first known",
        )


@pytest.mark.points(1)
def test_uneven(impl_dir):
    check_uneven(impl_dir)
