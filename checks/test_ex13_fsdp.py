"""Exercise 13: fully sharded data parallelism by hand (ZeRO-2, ZeRO-3), against torch's fully_shard.

The probes train the tests' own Stack: three layers of 91, 77 and 55 parameters (neither 2 nor 3
ranks divide them, and 2 and 3 ranks pad two of them differently) with tanh modules between them.
Memory is measured in the probe (course/memory.py: the buffers that all-gathers write into,
followed by weak reference, and the storages under the parameters, gradients and Adam's state),
never taken from the code under test.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from checks.comm_log import SUMMARY, CommLog
from checks.helpers import (
    CONFIG,
    WIDTHS,
    Given,
    block_outputs,
    computed_with_peers,
    describe_ratio,
    drawn,
    either,
    global_batch,
    kernel_counted,
    keyed,
    load,
    many,
    maybe,
    reference_world,
    tensor,
    world,
)
from course.grading.points import said
from course.memory import Gathered
from course.runtime.compat import full_tensor

LR = 0.01  # Adam's
STEPS = 5  # of the steps checks: a mistake in Adam's state or a shard's update shows after the first
UNITS = (0, 2, 4)  # the Stack's children with parameters
SIZES = (91, 77, 55)  # their parameters
N_CLASSES = 5
# float32 on W ranks against one process on the union batch: the same sums in another order. Measured
# here: at most 3e-8 after 5 steps of Adam on 2 ranks, 4.5e-8 after 3 on 3; on 1 rank exact (the same
# operations).
ATOL = 1e-6
# Against fully_shard (it shards each parameter by rows instead of one flat buffer), 2 steps on 2 ranks:
# measured 0 in float32 and in bfloat16 (both gather bfloat16 copies of the float32 shards and reduce in
# float32: the same operations). The same steps computed in float32 instead of bfloat16 end 2.2e-4
# away: the bfloat16 tolerance leaves room for another order of the sums and still tells the two apart.
TORCH_ATOL = {False: 1e-6, True: 5e-5}


class Stack(nn.Sequential):
    def __init__(self):
        super().__init__(
            nn.Linear(CONFIG.d_in, 7),
            nn.Tanh(),
            nn.Linear(7, 11, bias=False),
            nn.Tanh(),
            nn.Linear(11, N_CLASSES, bias=False),
        )


def stack(frozen=False):
    torch.manual_seed(0)
    model = Stack()
    if frozen:
        model[0].bias.requires_grad_(False)
    return model


def unit_name(k):
    layer = stack()[UNITS[k]]
    return f"unit {k} (Linear({layer.in_features}, {layer.out_features}), {SIZES[k]} parameters)"


def padded(n, world_size):
    return n + (-n % world_size)


def flat_of(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unit_flats(model, trainable=True):
    """The judge's: each unit's parameters (those that train), flattened, as a plain model holds them."""
    return [flat_of([p for p in model[i].parameters() if p.requires_grad or not trainable]) for i in UNITS]


def storage_bytes(tensors):
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def nothing_written(error):
    """A check's probe stops where the code under test is not written: the grader reports that itself."""
    if isinstance(error, NotImplementedError):
        raise error


# --- Part A: flat shards, views, the two collectives ---------------------------------------------------------

FLAT_CASES = [  # shapes of the tensors, world size, their dtype
    ([(3, 4), (5,)], 2, torch.float32),
    ([(3, 4), (5,)], 3, torch.float32),
    ([(7, 2), (3,), (2, 2)], 4, torch.float32),
    ([(2, 3)], 1, torch.float32),
    ([(3, 4), (5,)], 2, torch.float64),  # digits that float32 does not hold
    ([(2, 3), (3,)], 2, torch.bfloat16),
]


def case_tensors(shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(len(shapes))
    return [torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype) for shape in shapes]


def flat_shards(folder):
    """Probe: flat_shard of every case for every rank; each shard and the bytes of the storage under it."""
    fsdp = load(folder).fsdp
    out = []
    for shapes, world_size, dtype in FLAT_CASES:
        shards = [fsdp.flat_shard(case_tensors(shapes, dtype), rank, world_size) for rank in range(world_size)]
        out.append([(s.detach().clone(), s.untyped_storage().nbytes()) for s in shards])
    return out


def describe_shard(where, got, flat, rank, world_size):
    """Why a shard differs from piece `rank` of the padded flat tensor, from what it does hold, after `where`."""
    padding = -flat.numel() % world_size
    pieces = F.pad(flat, (0, padding)).chunk(world_size)
    size = pieces[0].numel()
    if got.numel() != size:
        return said(
            "a shard of the wrong size",
            f"{where} holds {got.numel()} elements; {flat.numel()} elements padded to a multiple of {world_size}"
            f" make {world_size} pieces of {size}",
        )
    for other, piece in enumerate(pieces):
        if torch.equal(got, piece):
            return said(
                "another rank's piece",
                f"{where} holds piece {other}: rank {rank} keeps piece {rank}, so that an all-gather, which puts"
                " the pieces in rank order, rebuilds the flat tensor",
            )
    if torch.equal(got, F.pad(flat, (0, padding))[rank::world_size]):
        return said(
            "a shard interleaved, not one contiguous piece",
            f"{where} holds the elements {rank}, {rank + world_size}, {rank + 2 * world_size}, ... of the padded"
            " flat tensor: a shard is one contiguous piece",
        )
    if torch.equal(got, F.pad(flat, (padding, 0)).chunk(world_size)[rank]):
        return said(
            "the padding at the front of the flat tensor",
            f"{where} is cut from the flat tensor padded at its front: the padding goes at the end, after the last"
            " tensor",
        )
    return said(
        "a shard not its piece of the padded flat tensor",
        f"{where} holds other values than piece {rank} of the flat tensor padded with zeros at its end",
    )


def check_flat_shard(folder):
    """flat_shard gives rank r piece r of the flat tensors padded at the end, as a tensor of its own."""
    got = world(flat_shards, 1, folder, expect=tuple(many((torch.Tensor, int), w) for _, w, _ in FLAT_CASES))[0]
    for (shapes, world_size, dtype), shards in zip(FLAT_CASES, got):
        flat = flat_of(case_tensors(shapes, dtype))
        expected = F.pad(flat, (0, -flat.numel() % world_size)).chunk(world_size)
        for rank, ((shard, nbytes), piece) in enumerate(zip(shards, expected)):
            name = str(dtype).removeprefix("torch.")
            where = (
                f"flat_shard of {name} tensors of shapes {shapes} ({flat.numel()} elements), rank {rank} of"
                f" {world_size}"
            )
            assert shard.dtype == dtype, said(
                "a shard of another dtype than its tensors",
                f"{where} is {str(shard.dtype).removeprefix('torch.')}: the shard holds the tensors' elements, in"
                " their dtype",
            )
            assert torch.equal(shard, piece), describe_shard(where, shard, flat, rank, world_size)
            assert nbytes == piece.numel() * piece.element_size(), said(
                "a shard that is a view of the whole flat tensor",
                f"{where}: the shard's storage holds {nbytes} bytes, the shard {piece.numel() * piece.element_size()}:"
                " a view of the whole flat tensor keeps all of it alive, where the docstring asks for a tensor of its own",
            )


VIEW_SHAPES = [(3, 4), (5,)]  # 17 elements of a flat tensor of 20: 3 of padding


def flat_views(folder):
    """Probe: views of a flat tensor of 20 as VIEW_SHAPES: values, storage offsets, and whether flat's memory is theirs."""
    fsdp = load(folder).fsdp
    flat = torch.arange(20, dtype=torch.float32)
    got = fsdp.views(flat, [torch.Size(s) for s in VIEW_SHAPES])
    return [
        (v.detach().clone(), v.storage_offset(), v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr())
        for v in got
    ]


def check_views(folder):
    """views gives views of flat's first elements in the given shapes, one after the other, the padding left out."""
    got = world(flat_views, 2, folder, expect=many((torch.Tensor, int, bool)))[
        0
    ]  # a pure function: rank 0's answer, in a world other checks use too
    where = f"views(torch.arange(20.), {VIEW_SHAPES})"
    assert len(got) == len(VIEW_SHAPES), said(
        "not one view per shape", f"{where} returned {len(got)} tensors: one per shape"
    )
    used = sum(value.numel() for value, _, _ in got)
    held = torch.cat([value.reshape(-1) for value, _, _ in got])
    assert not torch.equal(held, torch.arange(20 - used, 20, dtype=torch.float32)) or used == 20, said(
        "views that take the padding",
        f"{where}: the tensors hold flat's last {used} elements, the {20 - used} of padding among them: the"
        " padding is after the last tensor; view flat's first elements and leave the padding out",
    )
    offset = 0
    for (value, start, shares), shape in zip(got, VIEW_SHAPES):
        expected = torch.arange(offset, offset + value.numel(), dtype=torch.float32)
        assert tuple(value.shape) == shape, said(
            "a view of the wrong shape", f"{where}: a tensor of shape {tuple(value.shape)} where {shape} belongs"
        )
        assert torch.equal(value.reshape(-1), expected), said(
            "views that do not follow one another from element 0",
            f"{where}: the tensor of shape {shape} holds elements from {value.reshape(-1)[0].item():.0f}, expected"
            f" from {offset}: each view starts where the one before ends, the first at 0",
        )
        assert shares and start == offset, said(
            "views that are copies",
            f"{where}: the tensor of shape {shape} is a copy: the module must compute with the gathered memory"
            " itself (view, split), so that freeing it frees what the module used",
        )
        offset += value.numel()


SHARD_LENGTH = 4  # elements per rank in the collectives' probe


def gathers(folder):
    """Probe: free, then gather_into (float32 and bfloat16) from a shard that is an nn.Parameter, as a unit's
    is, each gather logged."""
    fsdp = load(folder).fsdp
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard = nn.Parameter(torch.arange(SHARD_LENGTH, dtype=torch.float32) + 10 * rank + 0.5)  # exact in bfloat16 too
    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        full = torch.full((SHARD_LENGTH * world_size,), -1.0, dtype=dtype)
        fsdp.free(full)
        out[f"freed_{name}"] = full.untyped_storage().nbytes()
        out[f"freed_shape_{name}"] = list(full.shape)
        if full.shape != (SHARD_LENGTH * world_size,):  # every rank alike: nothing to gather into
            return out
        error = ""
        with CommLog() as log:
            try:
                fsdp.gather_into(full, shard)
            except RuntimeError as caught:
                if SYMPTOMS["history"] not in str(caught):
                    raise  # the failure's own report, with the line of the code under test
                error = str(caught)
        # torch raises it in gloo's thread after the exchange, and now and then not on every rank: the ranks
        # agree, so that none goes on to an all-gather that the others never join.
        errors = [""] * world_size
        dist.all_gather_object(errors, error)
        if any(errors):
            return out | {"gather_error": next(e for e in errors if e)}
        out[f"gathered_{name}"], out[f"gather_log_{name}"] = full.clone(), log.summary()
    return out


def reduce_scatters(folder):
    """Probe: reduce_scatter_mean of float32 and bfloat16 full gradients, each logged (nothing else of
    fsdp.py runs: a free not written yet costs this check nothing)."""
    fsdp = load(folder).fsdp
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, dtype in REDUCED.items():
        g = torch.randn(3 * world_size, generator=torch.Generator().manual_seed(rank)).to(dtype)
        with CommLog() as log:
            piece = fsdp.reduce_scatter_mean(g)
        out[f"piece_{name}"], out[f"reduce_log_{name}"] = piece.clone(), log.summary()
    return out


def gathered():
    """What gathers returns: up to where it stopped (a free that gave full another shape, a gather that failed),
    or whole."""
    stopped, done = [], {}
    for name in ("float32", "bfloat16"):
        freed = done | {f"freed_{name}": int, f"freed_shape_{name}": many(int)}
        stopped += [freed, freed | {"gather_error": str}]
        done = freed | {f"gathered_{name}": torch.Tensor, f"gather_log_{name}": SUMMARY}
    return either(*stopped, done)


SCATTERED = {"piece": torch.Tensor, "reduce_log": SUMMARY}
REDUCED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}  # full's dtypes


def check_gather(folder, world_size=3):
    """free leaves full's storage empty; gather_into fills full with the ranks' shards in rank order, in full's
    dtype, with one all-gather."""
    got = world(gathers, world_size, folder, expect=gathered())
    shards = [torch.arange(SHARD_LENGTH, dtype=torch.float32) + 10 * r + 0.5 for r in range(world_size)]
    for rank, result in enumerate(got):
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            length = SHARD_LENGTH * world_size
            assert result[f"freed_shape_{name}"] == [length], said(
                "free replaces full with another tensor",
                f"after free(full) of a tensor of {length} elements, full has shape {result[f'freed_shape_{name}']}:"
                " free gave full other data, a new tensor, where it releases the memory under full and leaves full"
                " its shape (gather_into fills it again, and the views of full that autograd saved keep theirs)",
            )
            assert result[f"freed_{name}"] == 0, said(
                "free does not release the storage",
                f"after free(full), full's storage still holds {result[f'freed_{name}']} bytes: the memory under"
                " full stays, shared by the views of full that live on (dropping a name, or a view, releases none"
                " of it)",
            )
            assert "gather_error" not in result, said(
                "the shard given to the all-gather with its autograd history",
                f"gather_into(full, shard), with shard an nn.Parameter as a unit's is, failed (torch:"
                f" {result.get('gather_error', '')[:90]}...): the all-gather got a tensor that requires grad. Give"
                " it the shard's numbers without their history (a Parameter's .to() its own dtype is the Parameter"
                " itself)",
            )
            log, full = result[f"gather_log_{name}"], result[f"gathered_{name}"]
            expected = torch.cat(shards).to(dtype)
            if full.shape == expected.shape and not torch.equal(full, expected):
                order = [int(full[i * SHARD_LENGTH].item() // 10) for i in range(world_size)]
                assert sorted(order) != list(range(world_size)), said(
                    "shards gathered out of rank order",
                    f"on rank {rank}, gather_into put the ranks' shards in the order {order}: rank order",
                )
                raise AssertionError(
                    said(
                        "full not the ranks' shards one after the other",
                        f"on rank {rank}, gather_into filled full with {full.tolist()}, not the shards of ranks 0 to"
                        f" {world_size - 1} one after the other",
                    )
                )
            assert log["collectives"] == ["all_gather_into_tensor"], said(
                "not one all_gather_into_tensor",
                f"gather_into started {log['collectives'] or 'no collective'}: one dist.all_gather_into_tensor into full",
            )
            assert full.dtype == dtype and log["collective_dtypes"] == [name], said(
                "shards sent in another dtype than full's",
                f"gather_into a {name} full sent {log['collective_dtypes']}: cast the shard to full's dtype first,"
                " so that the wire carries the dtype the module computes in",
            )


def check_reduce_scatter(folder, world_size=3):
    """reduce_scatter_mean gives each rank its piece of the ranks' average, in float32, by one reduce-scatter
    in float32."""
    expect = {f"{what}_{name}": shape for name in REDUCED for what, shape in SCATTERED.items()}
    got = world(reduce_scatters, world_size, folder, expect=expect)
    for name, dtype in REDUCED.items():
        fulls = [torch.randn(3 * world_size, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
        mean = sum(f.to(dtype).float() for f in fulls) / world_size
        for rank, result in enumerate(got):
            log, piece = result[f"reduce_log_{name}"], result[f"piece_{name}"]
            expected = mean.chunk(world_size)[rank]
            if "allreduce" in log["collectives"]:
                raise AssertionError(
                    said(
                        "an all-reduce where a reduce-scatter belongs",
                        f"reduce_scatter_mean started {log['collectives']}: an all-reduce gives every rank the whole"
                        f" average ({world_size} times the piece it keeps) and sends twice the bytes; one"
                        " dist.reduce_scatter_tensor leaves each rank its piece",
                    )
                )
            assert log["collectives"] == ["reduce_scatter_tensor"], said(
                "not one reduce_scatter_tensor",
                f"reduce_scatter_mean started {log['collectives'] or 'no collective'}: one dist.reduce_scatter_tensor",
            )
            assert log["collective_dtypes"] == ["float32"] or dtype == torch.float64, said(
                "gradients reduced in bfloat16",
                f"reduce_scatter_mean of a {name} tensor reduced in {log['collective_dtypes'][0]}: reduce in float32"
                " (cast first): a sum of W bfloat16 gradients loses precision",
            )
            assert piece.dtype == torch.float32 and piece.shape == expected.shape, said(
                "a piece of the wrong dtype or size",
                f"reduce_scatter_mean of a {name} tensor returned {piece.dtype} of shape {tuple(piece.shape)}, expected"
                f" float32 of shape {tuple(expected.shape)}: 1/{world_size} of the elements, in float32 whatever"
                " full's dtype",
            )
            assert torch.allclose(piece, expected, rtol=1e-5, atol=1e-6), describe_ratio(
                f"its piece (reduce_scatter_mean of a {name} full gradient)", piece, expected, rank
            )


# Global sizes of flat tensors cut over 4 ranks: pieces of 3, 3, 3 and 1 real elements; 2, 2, 1 and none (rank 3's
# piece would start at 6, past the 5 elements); 1, 1, 1 and none (it would start at the end).
PIECE_SIZES = (10, 5, 3)
ALONE_SIZE = 7  # cut over a mesh of one rank: the whole flat tensor on every rank


def flat_pieces(folder):
    """Probe: flat_piece of this rank's shard of a flat tensor of each of PIECE_SIZES, on a mesh of every rank, then
    of ALONE_SIZE on a mesh of this rank alone (a sub-mesh: its rank 0 is this rank); each DTensor's global shape,
    local piece, whether that piece is the shard's memory, and the whole tensor."""
    from torch.distributed.device_mesh import init_device_mesh

    fsdp = load(folder).fsdp
    world_size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    alone = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("across", "alone"))["alone"]
    out = []
    for numel, on in [(n, mesh) for n in PIECE_SIZES] + [(ALONE_SIZE, alone)]:
        size = on.size()
        flat = torch.arange(1.0, numel + 1)  # no zero: padding that slips in shows
        shard = F.pad(flat, (0, -numel % size)).chunk(size)[on.get_local_rank()].clone()
        piece = fsdp.flat_piece(shard, numel, on)
        local = piece.to_local()
        shares = local.numel() == 0 or local.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
        out.append({"shape": list(piece.shape), "local": local.detach().clone(), "shares": shares})
        try:
            out[-1]["whole"] = full_tensor(piece).detach().clone()
        except Exception as error:  # noqa: BLE001 - a DTensor whose pieces do not make its shape: a fact
            nothing_written(error)
            out[-1]["whole_error"] = f"{type(error).__name__}: {str(error)[:200]}"
    return out


def check_flat_piece(folder, world_size=4):
    """flat_piece makes this rank's shard its piece of the flat tensor of the global size: the real elements
    only, in the shard's own memory, so that a checkpoint does not depend on the world size."""
    piece = {"shape": many(int), "local": torch.Tensor, "shares": bool}
    together = either(piece | {"whole_error": str}, piece | {"whole": torch.Tensor})
    # DTensor is what flat_piece makes: the exercise forbids it elsewhere (torch's fully_shard makes them)
    got = world(flat_pieces, world_size, folder, expect=many(together, len(PIECE_SIZES) + 1), allows=("DTensor",))
    for rank, result in enumerate(r[-1] for r in got):
        assert torch.equal(result["local"], torch.arange(1.0, ALONE_SIZE + 1)), said(
            "flat_piece's place from the world, not from the mesh",
            f"flat_piece over a mesh of one rank, a sub-mesh of the world of {world_size}, holds"
            f" {result['local'].tolist()} on rank {rank}, expected all {ALONE_SIZE} elements: a piece's place is this"
            " rank's place in the mesh it is given, which need not be its rank in the world",
        )
    for k, numel in enumerate(PIECE_SIZES):
        shard_size = padded(numel, world_size) // world_size
        for rank, result in enumerate(r[k] for r in got):
            where = (
                f"flat_piece of rank {rank}'s shard of {shard_size}, for a flat tensor of {numel} on {world_size} ranks"
            )
            real = torch.arange(1.0, numel + 1)[rank * shard_size : (rank + 1) * shard_size]
            assert result["shape"] == [numel], said(
                "the checkpoint's piece not of the global size",
                f"{where} is a DTensor of shape {result['shape']}: its global shape is the {numel} real elements,"
                f" whatever the world size (the padding to a multiple of {world_size} is this world's, not the"
                " checkpoint's)",
            )
            local = result["local"]
            assert rank * shard_size < numel or local.numel() == 0, said(
                "a piece that starts past the end not empty",
                f"{where} holds {local.numel()} elements: its place, element {rank * shard_size}, is at or past the"
                f" end of the {numel} real elements, so its piece is empty (a slice's end below 0 counts from the end)",
            )
            assert local.numel() <= real.numel() or not torch.equal(local[: real.numel()], real), said(
                "the padding kept in the checkpoint's piece",
                f"{where} holds {local.numel()} elements, {real.numel()} of them real: leave the padding out",
            )
            assert torch.equal(local, real), said(
                "the checkpoint's piece not the rank's real elements",
                f"{where} holds {local.tolist()}, expected {real.tolist()}: rank {rank}'s piece is its shard's"
                " elements that come before the global size",
            )
            assert result["shares"], said(
                "the checkpoint's piece a copy of the shard",
                f"{where} is a copy: loading a checkpoint into it would leave the shard as it was; give a view of"
                " the shard",
            )
        for result in (r[k] for r in got):  # every rank's piece is right: their DTensor too
            assert "whole_error" not in result and torch.equal(result["whole"], torch.arange(1.0, numel + 1)), said(
                "the pieces do not make the flat tensor",
                f"the pieces of a flat tensor of {numel} on {world_size} ranks do not put it back together:"
                f" {result.get('whole_error') or result['whole'].tolist()}",
            )


# --- Part B: units, ZeRO-2 and ZeRO-3 ------------------------------------------------------------------------


# Errors of torch that name a mistake of ZeRO-3, by the words of their message; a probe reports these
# as facts and lets every other error fail the world with its own report.
SYMPTOMS = {
    "freed": "for storage of size 0",  # a view of a freed buffer used: it was not gathered again
    "written": "is being modified inplace",  # an all-gather into full where autograd sees it
    "changed": "modified by an inplace operation",  # the same, seen in the backward
    "unread": "parameters freed before the module's forward",  # the tests' own hook's words
    "history": "A view was created in no_grad mode",  # an all-gather given a shard that requires grad
}


def shards_of(model):
    return [p for p in model.parameters() if p.requires_grad]


def sharded_steps(folder, zero3, steps, bf16=False, frozen=False, again=False):
    """Probe: the Stack with shard_layers, Adam over model.parameters(), `steps` steps on this rank's rows.

    Records what each layer computed with in each step's forward (its weights, as the module saw them),
    each step's collectives and its shards' gradients, the gathered buffers alive along step 0
    (course/memory.py), this rank's shards after each step, and the bytes under the shards, their
    gradients and Adam's state. With `again`, the last step runs its forward and backward twice."""
    fsdp = load(folder).fsdp
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {"alone": passed_through(fsdp)}
    if out["alone"] != "Tanh":
        return out
    model = stack(frozen)
    layers = [model[i] for i in UNITS]  # the units keep the layer modules: hooks on them see the forward
    out["flat_sizes"] = flat_sizes(fsdp, [[p for p in m.parameters() if p.requires_grad] for m in layers])
    seen, now = [], {}

    def remember(k):
        def hook(module, inputs):
            if not readable(module.weight):  # reading it would crash the process, in the module's forward too
                raise RuntimeError(f"{SYMPTOMS['unread']} of unit {k}")
            seen[-1].append([module.weight.detach().clone()] + ([module.bias.detach().clone()] if k == 0 else []))
            now["gathered"].mark(f"forward {k}")

        return hook

    for k, layer in enumerate(layers):
        layer.register_forward_pre_hook(remember(k))
    fsdp.shard_layers(model, reshard_after_forward=zero3, param_dtype=torch.bfloat16 if bf16 else None)
    out |= {"children": [type(child).__name__ for child in model.children()]}
    out["shapes"] = [list(p.shape) for p in shards_of(model)]
    out["born"] = [unit.full.untyped_storage().nbytes() for _, unit in fsdp.units(model)]  # before any forward
    if len(out["shapes"]) != len(UNITS):
        return out
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    out |= {"history": [], "logs": [], "grads": [], "seen": seen}
    for step in range(steps):
        x, y = global_batch(CONFIG, step, world_size)
        mine = slice(rank * CONFIG.batch_size, (rank + 1) * CONFIG.batch_size)
        optimizer.zero_grad()
        for _ in range(2 if again and step == steps - 1 else 1):
            seen.append([])
            with CommLog() as log, Gathered() as gathered:
                now["gathered"] = gathered
                try:
                    loss = F.cross_entropy(model(x[mine]).float(), y[mine])
                    gathered.mark("backward")
                    loss.backward()
                except RuntimeError as error:
                    if not any(symptom in str(error) for symptom in SYMPTOMS.values()):
                        raise  # the failure's own report, with the line of the code under test
                    return out | {"error": str(error)}
                gathered.mark("end")
        out["logs"].append(log.summary())
        out["grads"].append([None if p.grad is None else p.grad.clone() for p in shards_of(model)])
        if step == 0:
            out["samples"] = gathered.samples
            out["grad_bytes"] = storage_bytes([p.grad for p in shards_of(model) if p.grad is not None])
        optimizer.step()
        out["history"].append([p.detach().clone() for p in shards_of(model)])
    seen.append([])  # evaluation, a forward with no backward to come: not a step's, nor sampled with its memory
    out["evaluated_bytes"] = 0  # what the gathers of an evaluation's forward still hold after it
    model.eval()
    try:
        with torch.no_grad(), Gathered() as evaluated:
            now["gathered"] = evaluated
            model(global_batch(CONFIG, 0, world_size)[0][: CONFIG.batch_size])
        out["no_grad"] = None
        out["evaluated_bytes"] = evaluated.alive_bytes()
    except RuntimeError as error:
        out["no_grad"] = f"{type(error).__name__}: {str(error)[:200]}"
    finally:
        model.train()
    seen.pop()
    out["param_bytes"] = storage_bytes(shards_of(model))
    out["state_bytes"] = sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    bias = layers[0].bias
    out["frozen_bias"] = bias.detach().clone() if frozen and readable(bias) else None
    return out


def stepped(steps, again=False):
    """What sharded_steps returns: up to where it stopped, if it did (refuse_unsharded says why)."""
    units = len(UNITS)
    wrapped = {
        "alone": str,
        "children": many(str),
        "shapes": many(many(int)),
        "flat_sizes": maybe(many(int)),
        "born": many(int),
    }
    sample = {"at": str, "alive": many(int), "bytes": int, "numel": maybe(int)}
    complete = wrapped | {
        "history": many(many(torch.Tensor, units), steps),
        "logs": many(SUMMARY, steps),
        "grads": many(many(maybe(torch.Tensor), units), steps),
        "seen": many(many(many(torch.Tensor), units), steps + again),
        "samples": many(sample),
        "grad_bytes": int,
        "param_bytes": int,
        "state_bytes": int,
        "frozen_bias": maybe(torch.Tensor),
        "evaluated_bytes": int,
    }
    return either({"alone": str}, wrapped, wrapped | {"error": str}, complete)


def flat_sizes(fsdp, groups):
    """The sizes of flat_shard's pieces of each group of tensors on this rank; None before it is written (the
    units are then judged alone)."""
    try:
        return [fsdp.flat_shard(tensors, dist.get_rank(), dist.get_world_size()).numel() for tensors in groups]
    except NotImplementedError:
        return None


def passed_through(fsdp):
    """What shard_layers makes of a container holding one module without parameters (a Tanh)."""
    container = nn.Sequential(nn.Tanh())
    try:
        fsdp.shard_layers(container)
        return type(container[0]).__name__
    except Exception as error:  # noqa: BLE001 - what it raised is the fact to report
        nothing_written(error)
        return f"{type(error).__name__}: {str(error)[:200]}"


def readable(tensor):
    """Whether a tensor's storage holds its elements: reading a view of a freed buffer crashes the process."""
    needed = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    return tensor.untyped_storage().nbytes() >= needed


def one_process(world_size, steps, frozen=False):
    """The judge's run: Adam on the union batch; each unit's flat parameters before and after each step, and
    in each step each rank's own flat gradients."""
    model = stack(frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=LR)
    history, local = [unit_flats(model)], []
    for step in range(steps):
        x, y = global_batch(CONFIG, step, world_size)
        local.append([])
        for r in range(world_size):
            model.zero_grad()
            mine = slice(r * CONFIG.batch_size, (r + 1) * CONFIG.batch_size)
            F.cross_entropy(model(x[mine]), y[mine]).backward()
            local[-1].append([flat_of([p.grad for p in model[i].parameters() if p.requires_grad]) for i in UNITS])
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        history.append(unit_flats(model))
    return history, local


def whole(results, step, k, sizes=SIZES):
    """Unit k's flat parameters after `step`, from the ranks' shards (in rank order), the padding left out."""
    return torch.cat([r["history"][step][k] for r in results])[: sizes[k]]


def refuse_flat_shard(got, sizes, rank, world_size):
    """flat_shard's pieces of units of `sizes` trainable parameters are 1/W of them padded to a multiple of W: a
    fact that every check of units builds on, said as flat_shard's."""
    expected = [padded(n, world_size) // world_size for n in sizes]
    assert got == expected, said(
        "flat_shard's pieces not 1/W of the padded parameters",
        f"on rank {rank} of {world_size}, flat_shard cuts units of {list(sizes)} trainable parameters into pieces of"
        f" {got} elements, where 1/W of them padded to the next multiple of W is {expected}: every unit"
        " shards with it (flat_shard's own check says more)",
    )


def refuse_unsharded(results, sizes=SIZES):
    """flat_shard cuts the units' pieces right, shard_layers wraps exactly the children that train, and ZeRO-3's
    backward runs: the facts that stop every check of a run before its numbers."""
    for rank, result in enumerate(results):
        if result.get("flat_sizes") is not None:
            refuse_flat_shard(result["flat_sizes"], sizes, rank, len(results))
        assert result["alone"] == "Tanh", said(
            "a module without parameters wrapped",
            f"shard_layers(nn.Sequential(nn.Tanh())) made its child {result['alone']}: a module without parameters"
            " is passed through as it is",
        )
        children = result["children"]
        assert children[1] == children[3] == "Tanh", said(
            "a module without parameters wrapped",
            f"after shard_layers the Stack's children are {children}: a module without parameters (Tanh) is"
            " passed through as it is",
        )
        assert len(result["shapes"]) == len(UNITS), said(
            "not one flat shard per unit in model.parameters()",
            f"after shard_layers, model.parameters() on rank {rank} holds {len(result['shapes'])} tensors that"
            f" train, of shapes {result['shapes']}: one flat shard per unit, {len(UNITS)} units (the module's own"
            " parameters must go, and the gathered full tensor is no parameter)",
        )
        error = result.get("error", "")
        assert SYMPTOMS["unread"] not in error, said(
            "parameters freed before the module's forward",
            f"on rank {rank}, {error.split(' of ')[-1]}'s module was called with freed parameters: the unit freed its"
            " gathered parameters before the module's forward had run on them",
        )
        assert SYMPTOMS["freed"] not in error, said(
            "freed parameters read in the backward",
            f"the backward pass read a unit's freed parameters (torch: {error[:100]}...): gather them again before"
            " the unit's backward (pre_backward, a hook on the output of the unit's forward)",
        )
        assert SYMPTOMS["history"] not in error, said(
            "the shard given to the all-gather with its autograd history",
            f"the all-gather of gather_into failed (torch: {error[:90]}...): it got the shard, which requires grad;"
            " give it the shard's numbers without their history",
        )
        assert not any(symptom in error for symptom in (SYMPTOMS["written"], SYMPTOMS["changed"])), said(
            "the gather's write seen by autograd",
            f"autograd refused gather_into's write into the gathered parameters (torch: {error[:100]}...): it"
            " sees full and the views of it it saved in the forward; write through full.data",
        )


def check_seen(results, step, bf16=False, sizes=SIZES):
    """Each unit computes the forward of `step` with its shards after the step before, gathered (the ranks' own,
    sent by the probe), the padding left out; exactly, as gathering computes nothing."""
    start = unit_flats(stack())

    def after(s, k):  # unit k's parameters after step s; s = -1: the start
        return start[k] if s < 0 else whole(results, s, k, sizes)

    for k in range(len(UNITS)):
        for rank, result in enumerate(results):
            got, expected = flat_of(result["seen"][step][k]), after(step - 1, k)
            if bf16:
                assert got.dtype == torch.bfloat16, said(
                    "param_dtype=torch.bfloat16 not computed in bfloat16",
                    f"in the forward of step {step}, {unit_name(k)} computed with {got.dtype} weights: with"
                    " param_dtype=torch.bfloat16 it computes from gathered bfloat16 copies",
                )
                expected = expected.to(torch.bfloat16)
            if torch.equal(got, expected):
                continue
            assert not (step > 0 and torch.equal(got, after(step - 2, k).to(got.dtype))), said(
                "parameters not gathered again after a step",
                f"in the forward of step {step}, {unit_name(k)} computed with its parameters from before step"
                f" {step - 1}: gather the updated shards before every forward",
            )
            pad = -SIZES[k] % len(results)
            flat = expected.reshape(-1)
            assert not (pad and torch.equal(got.reshape(-1)[pad:], flat[:-pad])), said(
                "the padding at the front of the flat tensor",
                f"in the forward of step {step}, {unit_name(k)} computed with its parameters shifted by {pad}"
                " element(s), zeros first: the padding goes at the end, after the last parameter",
            )
            assert not (pad and torch.equal(got.reshape(-1), F.pad(flat[pad:], (0, pad)))), said(
                "views that take the padding",
                f"in the forward of step {step}, {unit_name(k)} computed with its parameters from element {pad} on"
                f" and {pad} element(s) of padding: its views take the gathered tensor's first elements, the"
                " padding after them left out",
            )
            assert not (got.numel() == expected.numel() and torch.equal(got.sort().values, expected.sort().values)), (
                said(
                    "parameters gathered out of order",
                    f"in the forward of step {step}, {unit_name(k)} on rank {rank} computed with its parameters in"
                    " another order: do the shards come back in rank order, the padding at the end?",
                )
            )
            raise AssertionError(
                said(
                    "a unit's forward not on its gathered parameters",
                    f"in the forward of step {step}, {unit_name(k)} on rank {rank} did not compute with its"
                    " parameters (gathered from the shards, the padding left out)",
                )
            )


# A unit wide enough that its exchanges dwarf what a world's network carries for nothing (its barriers and
# checks, a few kB): the kernel's count of them bounds what no worker can write.
WIDE = 256


def wide_model(world_size):
    """The wide model's two layers (biases 0: only the gathers decide its output, whatever the code does with a
    bias) and each rank's rows, drawn (drawn()), and what each rank is given of them: its rows, and of each
    unit the numbers of its own piece of the flat parameters, the rest of the weight and bias other numbers
    drawn for this rank alone. A rank can compute its output only with the pieces its peers hold; one that
    computes from the whole model it was given computes another."""
    generator = drawn(1300)
    shapes = [(WIDE, WIDE), (N_CLASSES, WIDE)]
    layers = [(torch.randn(shape, generator=generator) / WIDE**0.5, torch.zeros(shape[0])) for shape in shapes]
    rows = CONFIG.batch_size
    model = {"layers": layers, "x": torch.randn(world_size * rows, WIDE, generator=generator)}

    def given(model):
        parts = []
        for rank in range(world_size):
            other, own = drawn(1301 + rank), []
            for weight, bias in model["layers"]:
                numbers = weight.numel() + bias.numel()
                piece = padded(numbers, world_size) // world_size
                values = torch.randn(numbers, generator=other) / WIDE**0.5
                mine = slice(rank * piece, min((rank + 1) * piece, numbers))
                values[mine] = flat_of([weight, bias])[mine]
                own.append((values[: weight.numel()].view(weight.shape), values[weight.numel() :]))
            parts.append((own, model["x"][rank * rows : (rank + 1) * rows]))
        return parts

    return Given(lambda: model, given)


def wide_step_in_world(folder, layers, x):
    """Probe: one ZeRO-3 step's forward and backward of a model of two units made from what this rank was given
    (wide_model), on its rows; its output."""
    fsdp = load(folder).fsdp
    model = nn.Sequential(nn.Linear(WIDE, WIDE), nn.Tanh(), nn.Linear(WIDE, N_CLASSES))
    with torch.no_grad():
        for k, (weight, bias) in zip((0, 2), layers):
            model[k].weight.copy_(weight)
            model[k].bias.copy_(bias)
    fsdp.shard_layers(model, reshard_after_forward=True)
    out = model(x)
    out.sum().backward()
    return out.detach()


def check_kernel_count(folder, world_size):
    """Each rank given its own pieces of the wide model only, its output is one process's, and the kernel counted
    at least one all-gather of the model's parameters in that call: units that keep the whole model on every rank
    fail, whatever the communication log says; so do units that get their peers' pieces but not over the world's
    network."""
    given = wide_model(world_size)
    observed = world(wide_step_in_world, world_size, folder, expect=torch.Tensor, observe=True, per_rank=given)
    parameters = WIDE * WIDE + WIDE + WIDE * N_CLASSES + N_CLASSES
    what = f"one ZeRO-3 step of a model of {parameters} parameters on {world_size} ranks"
    computed_with_peers(
        block_outputs(observed.results, given),
        f"{what}, each rank given only its own piece of each unit (the rest of the weights and biases: other numbers)",
        (
            "units that compute from the whole model themselves",
            "the whole model it was given",
            "A rank keeps its piece only; the rest of each unit's parameters comes from the other ranks, by the"
            " unit's all-gather",
        ),
        "units wrong when each rank holds only its piece",
    )
    # Every rank gathers the W - 1 pieces it does not hold, in float32, before the forward at least.
    least = (world_size - 1) * parameters * 4
    kernel_counted(
        observed,
        least,
        "units that exchange nothing",
        what,
        "gathering the pieces of its parameters that a rank does not hold carries",
    )


def check_steps(folder, world_size, zero3, steps=None):
    """The STEPS of Adam on W ranks equal one process on the union batch: exactly on 1 rank, within ATOL on more;
    ZeRO-3's units gather what the kernel sees them gather (check_kernel_count)."""
    steps = steps or STEPS
    results = world(sharded_steps, world_size, folder, zero3, steps, expect=stepped(steps))
    refuse_unsharded(results)
    history, _ = one_process(world_size, steps)
    gathers = 2 * len(UNITS) if zero3 else len(UNITS)
    for rank, result in enumerate(results):
        assert result.get("no_grad") is None, said(
            "a unit's forward fails under torch.no_grad()",
            f"on rank {rank}, the model's forward under torch.no_grad() (as in evaluation) raised"
            f" {result['no_grad']}: there the output requires no gradient and no backward will come, so there is"
            " nothing to gather again for",
        )
        assert not (zero3 and result.get("evaluated_bytes")), said(
            "a unit's forward in evaluation keeps its gathered parameters",
            f"on rank {rank}, after the model's forward in evaluation (model.eval(), torch.no_grad()), the units'"
            f" gathered parameters still hold {result.get('evaluated_bytes')} B: ZeRO-3 frees them after every"
            " forward, in training or not (there no backward comes to free them); kept, an evaluation holds the"
            " whole model on every rank",
        )
    for step in range(steps):
        check_seen(results, step)
        for rank, result in enumerate(results):
            done = result["logs"][step]["collectives"]
            assert done.count("all_gather_into_tensor") == gathers, said(
                "not one all-gather before each unit's forward (and backward, ZeRO-3)",
                f"in step {step}, rank {rank} started {done.count('all_gather_into_tensor')} dist.all_gather_into_tensor for"
                f" {len(UNITS)} units, expected {gathers}: "
                + (
                    "one before each unit's forward and one before its backward"
                    if zero3
                    else "one before each unit's forward (ZeRO-2 keeps the gathered parameters for the backward)"
                ),
            )
        for k in range(len(UNITS)):
            got, expected = whole(results, step, k), history[step + 1][k]
            if world_size == 1:
                assert torch.equal(got, expected), said(
                    "one rank's numbers not exactly one process's",
                    f"after step {step} on 1 rank, {unit_name(k)} differs from one process (by"
                    f" {(got - expected).abs().max().item():.1e}): with one rank the operations are the same, and"
                    " so must the numbers be",
                )
            assert torch.allclose(got, expected, rtol=0, atol=ATOL), (
                f"after step {step} on {world_size} ranks, {unit_name(k)} differs from Adam in one process on the"
                f" union batch by {(got - expected).abs().max().item():.1e} (tolerance {ATOL:.0e})"
            )
    if zero3 and world_size > 1:  # last: a mistake that the steps show is said as the steps say it
        check_kernel_count(folder, world_size)


def piece(flat, world_size, rank):
    """Piece `rank` of a flat tensor padded with zeros to a multiple of world_size."""
    return F.pad(flat, (0, -flat.numel() % world_size)).chunk(world_size)[rank]


def check_gradient_shards(folder, world_size=2, steps=2):
    """After each backward, each rank's shard.grad is its piece of that step's averaged full gradient, reduce-scattered;
    two backward passes without zero_grad leave the sum of both."""
    results = world(sharded_steps, world_size, folder, True, steps, False, False, True, expect=stepped(steps, True))
    refuse_unsharded(results)
    _, local = one_process(world_size, steps)
    shard_bytes = [padded(n, world_size) // world_size * 4 for n in SIZES]
    for rank, result in enumerate(results):
        done = result["logs"][0]
        assert "allreduce" not in done["collectives"], said(
            "gradients all-reduced, not reduce-scattered",
            f"rank {rank}'s step started {done['collectives']}: an all-reduce gives every rank the whole averaged"
            f" gradient, {world_size} times the shard it keeps; reduce-scatter (dist.reduce_scatter_tensor)",
        )
        for step in range(steps):
            twice = step == steps - 1
            for k in range(len(UNITS)):
                grad = result["grads"][step][k]
                mean = sum(g[k] for g in local[step]) / world_size
                expected = piece(mean, world_size, rank) * (2 if twice else 1)
                what = f"shard of {unit_name(k)}" + (" after two backward passes" if twice else "")
                assert grad is not None, said(
                    "a shard without a gradient",
                    f"after the backward of step {step}, rank {rank}'s {what} has no .grad",
                )
                assert grad.dtype == torch.float32 and grad.shape == expected.shape, said(
                    "a shard's gradient not float32 of its shape",
                    f"rank {rank}'s {what} has a {grad.dtype} gradient of shape {tuple(grad.shape)}, its shard is"
                    f" float32 of shape {tuple(expected.shape)}",
                )
                if torch.allclose(grad, expected, rtol=1e-4, atol=1e-6):
                    continue
                if step > 0:  # what the gradient is made of: a * step 0's average + b * this step's
                    before = sum(g[k] for g in local[step - 1]) / world_size
                    basis = torch.stack([piece(before, world_size, rank), piece(mean, world_size, rank)], dim=1)
                    a, b = torch.linalg.lstsq(basis, grad.unsqueeze(1)).solution.reshape(-1).tolist()
                    assert abs(a) < 0.05, said(
                        "the previous step's gradient kept in the shard",
                        f"in step {step}, rank {rank}'s {what} holds step {step - 1}'s gradient too: step {step - 1}'s"
                        " full gradient was still in full.grad when this step's backward added to it (and a full"
                        " gradient per unit kept alive is memory too)",
                    )
                    assert not (twice and abs(b - 1) < 0.05), said(
                        "a second backward replacing the shard's gradient, not adding to it",
                        f"rank {rank}'s {what} holds the second pass's gradient only: add to shard.grad when it is"
                        " there already, as autograd does for a parameter",
                    )
                raise AssertionError(describe_ratio(f"its {what}", grad, expected, rank, f"in step {step}, "))
        scatters = [b for c, b in zip(done["collectives"], done["collective_bytes"]) if c == "reduce_scatter_tensor"]
        assert sorted(scatters) == sorted(shard_bytes), said(
            "not one reduce-scatter per unit",
            f"rank {rank}'s backward reduce-scattered {scatters} bytes, one float32 shard per unit is"
            f" {shard_bytes[::-1]}: one reduce-scatter per unit, after its backward",
        )


def check_sharded_bytes(folder, world_size=3):
    """Per rank: the parameters that train, their gradients and Adam's state each hold 1/W of the model's (and padding)."""
    results = world(sharded_steps, world_size, folder, True, 1, expect=stepped(1))
    refuse_unsharded(results)
    shard = sum(padded(n, world_size) // world_size * 4 for n in SIZES)
    whole_model = sum(SIZES) * 4
    for rank, result in enumerate(results):
        params, grads, state = result["param_bytes"], result["grad_bytes"], result["state_bytes"]
        sits = f"rank {rank}'s shards sit on {params} bytes of storage, the shards are {shard} bytes (the whole model {whole_model})"
        assert params <= shard, said(
            "a shard that is a view of the whole flat tensor",
            f"{sits}: a shard that is a view of the whole flat tensor keeps all of it",
        )
        assert params == shard, said("shards smaller than 1/W of the model", sits)
        sits = f"rank {rank}'s shards' gradients sit on {grads} bytes of storage, the shards are {shard} bytes"
        assert grads <= shard, said(
            "a gradient shard cut from a full gradient",
            f"{sits}: a piece cut from a full gradient (an all-reduce's, say) keeps all of it",
        )
        assert grads == shard, said("gradient shards smaller than 1/W of the model", sits)
        adam = 2 * shard + 4 * len(UNITS)  # exp_avg and exp_avg_sq of each shard, and its float32 step
        assert state == adam, (
            f"rank {rank}'s Adam state holds {state} bytes; over the shards it holds {adam} (2 x {shard} and a"
            f" step per shard), over the whole model {2 * whole_model + 4 * 4}: the optimizer must see the shards"
        )


def describe_units(counts, world_size):
    """Unit names for the element counts of gathered buffers."""
    by_size = {padded(n, world_size): k for k, n in enumerate(SIZES)}
    return [unit_name(by_size[n]) if n in by_size else f"a buffer of {n} elements" for n in counts]


def check_memory(folder, world_size=2):
    """ZeRO-3: the gathered parameters alive at once through the forward and backward are at most two units' worth;
    a unit's are freed after its forward and after its backward."""
    results = world(sharded_steps, world_size, folder, True, 1, expect=stepped(1))
    refuse_unsharded(results)
    by_size = {padded(n, world_size): k for k, n in enumerate(SIZES)}
    limit = sum(sorted(padded(n, world_size) * 4 for n in SIZES)[-2:])
    for rank, result in enumerate(results):
        held = [(unit_name(k), n) for k, n in enumerate(result["born"]) if n]
        assert not held, said(
            "a unit's full parameters not freed when it is made",
            f"right after shard_layers, before any forward, on rank {rank} {held[0][0]}'s self.full held {held[0][1]}"
            " bytes: a unit is made with its full buffer freed (between steps a rank holds 1/W of everything)",
        )
        samples, phase, forwards, scattered = result["samples"], "forward", set(), set()
        for sample in samples:
            at, alive = sample["at"], [by_size.get(n) for n in sample["alive"]]
            if at == "backward":
                phase = "backward"
            if phase == "forward" and at == "all_gather_into_tensor" and sample["numel"] in by_size:
                k = by_size[sample["numel"]]
                assert k == 0 or k - 1 in forwards, said(
                    "units gathered up front, not each before its forward",
                    f"rank {rank} gathered {unit_name(k)} before {unit_name(k - 1)}'s forward had run: gather each"
                    " unit's parameters just before its own forward, not all of them up front",
                )
            if at.startswith("forward "):
                k = int(at.split()[1])
                forwards.add(k)
                kept = [unit_name(i) for i in alive if i is not None and i < k]
                assert not kept, said(
                    "a unit's parameters not freed after its forward",
                    f"when {unit_name(k)}'s forward began on rank {rank}, {', '.join(kept)} still held its gathered"
                    " parameters: free them after the unit's forward (free: the storage, not the name)",
                )
            if phase == "backward" and at == "reduce_scatter_tensor" and sample["numel"] in by_size:
                scattered.add(by_size[sample["numel"]])
            if phase == "backward" and at != "end":
                kept = [unit_name(i) for i in alive if i in scattered and by_size.get(sample["numel"]) != i]
                assert not kept, said(
                    "a unit's parameters not freed after its backward",
                    f"in the backward on rank {rank}, {', '.join(kept)} still held its gathered parameters after its"
                    " gradient was reduce-scattered: free them after the unit's backward too",
                )
            if at == "end":
                assert not sample["alive"], said(
                    "gathered parameters alive after the backward",
                    f"after the backward on rank {rank}, {', '.join(describe_units(sample['alive'], world_size))}"
                    " still held gathered parameters: ZeRO-3 frees every unit's after its backward",
                )
            assert sample["bytes"] <= limit, (
                f"on rank {rank}, {sample['bytes']} bytes of gathered parameters were alive at once (at"
                f" {at}: {', '.join(describe_units(sample['alive'], world_size))}); two units' worth is {limit}"
            )


def check_zero2_keeps(folder, world_size=2):
    """ZeRO-2: the gathered parameters stay (the whole model on each rank), the gradients are sharded."""
    results = world(sharded_steps, world_size, folder, False, 1, expect=stepped(1))
    refuse_unsharded(results)
    for rank, result in enumerate(results):
        end = next(s for s in result["samples"] if s["at"] == "end")
        expected = sorted(padded(n, world_size) for n in SIZES)
        assert sorted(end["alive"]) == expected, (
            f"after the backward of ZeRO-2 on rank {rank}, the gathered buffers alive held"
            f" {sorted(end['alive']) or 'nothing'} (elements); the units' full parameters are {expected}: ZeRO-2"
            " keeps them (reshard_after_forward=False)"
        )


# --- Frozen parameters, mixed precision -----------------------------------------------------------------------

FROZEN_SIZES = (84, 77, 55)  # unit 0's bias frozen


def check_frozen(folder, world_size=2, steps=1):
    """A frozen parameter stays in its module, whole and unchanged, and out of the reduce-scatter."""
    results = world(sharded_steps, world_size, folder, True, steps, False, True, expect=stepped(steps))
    refuse_unsharded(results, FROZEN_SIZES)
    history, _ = one_process(world_size, steps, frozen=True)
    start = stack()[0].bias.detach()
    for rank, result in enumerate(results):
        assert result["frozen_bias"] is not None and torch.equal(result["frozen_bias"], start), (
            f"on rank {rank} the frozen bias of unit 0 changed: a parameter with requires_grad=False stays in its"
            " module as it is, out of the shard"
        )
        scatters = [
            b
            for c, b in zip(result["logs"][0]["collectives"], result["logs"][0]["collective_bytes"])
            if c == "reduce_scatter_tensor"
        ]
        expected = padded(FROZEN_SIZES[0], world_size) // world_size * 4
        assert expected in scatters, said(
            "a frozen parameter in the flat shard's reduce-scatter",
            f"rank {rank} reduce-scattered {scatters} bytes; unit 0's trainable weight makes a shard of {expected}:"
            " the frozen bias stays out of the flat shard and its reduce-scatter",
        )
    for k in range(len(UNITS)):
        got = whole(results, steps - 1, k, FROZEN_SIZES)
        assert torch.allclose(got, history[-1][k], rtol=0, atol=ATOL), said(
            "training with a frozen parameter not one process's",
            f"with unit 0's bias frozen, after {steps} steps {unit_name(k)} differs from one process",
        )


def check_mixed_precision(folder, world_size=2):
    """param_dtype=torch.bfloat16: bfloat16 copies gathered (half the bytes), float32 shards and gradients, float32 reduced."""
    results = world(sharded_steps, world_size, folder, True, 1, True, expect=stepped(1))
    refuse_unsharded(results)
    check_seen(results, 0, bf16=True)
    for rank, result in enumerate(results):
        log = result["logs"][0]
        kinds = {
            c: {d for c2, d in zip(log["collectives"], log["collective_dtypes"]) if c2 == c}
            for c in set(log["collectives"])
        }
        assert kinds.get("all_gather_into_tensor") == {"bfloat16"}, said(
            "parameters not gathered in bfloat16",
            f"with param_dtype=torch.bfloat16, rank {rank} all-gathered {kinds.get('all_gather_into_tensor')}: gather"
            " bfloat16 copies of the shards (half the bytes of float32)",
        )
        assert kinds.get("reduce_scatter_tensor") == {"float32"}, said(
            "gradients not reduced in float32",
            f"with param_dtype=torch.bfloat16, rank {rank} reduce-scattered {kinds.get('reduce_scatter_tensor')}:"
            " reduce the gradients in float32",
        )
        shards = [str(s.dtype) for s in result["history"][0]]
        grads = [str(g.dtype) if g is not None else None for g in result["grads"][0]]
        assert shards == ["torch.float32"] * len(UNITS) and grads == shards, said(
            "shards or their gradients not float32",
            f"with param_dtype=torch.bfloat16, rank {rank}'s shards are {shards} with gradients {grads}: the"
            " master shards and their gradients stay float32",
        )


# --- Any module: integer inputs, a wholly frozen layer, another dtype ---------------------------------------

VOCAB = 10
ODD_SIZES = (VOCAB * 6, 7 * N_CLASSES + N_CLASSES)  # the two units' parameters: the embedding, the last Linear
ODD_UNITS = ("nn.Embedding(10, 6)", "the float64 Linear(7, 5)")


def odd_model():
    """An embedding (integer inputs), a Linear wholly frozen (no parameter trains), a Tanh and a Linear: float32,
    as the judge runs it; the probe makes the last Linear float64."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Embedding(VOCAB, 6), nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, N_CLASSES))
    model[1].requires_grad_(False)
    return model


def odd_batch(world_size):
    g = torch.Generator().manual_seed(13)
    rows = world_size * CONFIG.batch_size
    return torch.randint(0, VOCAB, (rows,), generator=g), torch.randint(0, N_CLASSES, (rows,), generator=g)


def odd_step(folder):
    """Probe: shard_layers (ZeRO-3) on odd_model with its last Linear float64, Adam over model.parameters(), one step
    on this rank's rows; the children, the shards' dtypes, the bytes each unit's full.grad holds after the backward,
    the shards after the step and the frozen layer; or where it failed, and how."""
    fsdp = load(folder).fsdp
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = odd_model()
    model[3].double()
    try:
        fsdp.shard_layers(model)
    except Exception as error:  # noqa: BLE001 - what it raised is the fact to report
        nothing_written(error)
        return {"failed": ["shard_layers", f"{type(error).__name__}: {str(error)[:200]}"]}
    out = {"children": [type(child).__name__ for child in model.children()]}
    unit_list = [unit for _, unit in fsdp.units(model)]
    out["dtypes"] = [str(unit.shard.dtype).removeprefix("torch.") for unit in unit_list]
    if out["dtypes"] != ["float32"] * len(ODD_SIZES):
        return out
    x, y = odd_batch(world_size)
    mine = slice(rank * CONFIG.batch_size, (rank + 1) * CONFIG.batch_size)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    try:
        F.cross_entropy(model(x[mine]).float(), y[mine]).backward()
    except RuntimeError as error:
        return out | {"failed": ["step", f"{type(error).__name__}: {str(error)[:200]}"]}
    grads = [unit.full.grad for unit in unit_list]
    out["full_grads"] = [0 if g is None else g.untyped_storage().nbytes() for g in grads]
    optimizer.step()
    out["shards"] = [unit.shard.detach().clone() for unit in unit_list]
    out["frozen"] = [p.detach().clone() for p in model[1].parameters()]
    return out


def check_any_module(folder, world_size=2):
    """A unit runs any module: integer inputs reach an embedding as they are, a layer with no parameter to train is
    passed through, a float64 layer's shard is float32; its full gradient is freed after the backward."""
    model = odd_model()
    said_model = "a model of nn.Embedding(10, 6), a wholly frozen Linear(6, 7), Tanh and a float64 Linear(7, 5)"
    wrapped = {"children": many(str), "dtypes": many(str)}
    whole_result = wrapped | {
        "full_grads": many(int, 2),
        "shards": many(torch.Tensor, 2),
        "frozen": many(torch.Tensor, 2),
    }
    shapes = either({"failed": (str, str)}, wrapped, wrapped | {"failed": (str, str)}, whole_result)
    results = world(odd_step, world_size, folder, expect=shapes)
    for rank, result in enumerate(results):
        where, error = result.get("failed", ("", ""))
        assert where != "shard_layers", said(
            "a wholly frozen layer wrapped",
            f"shard_layers on {said_model} raised {error}: a child with no parameter to train (the frozen"
            " Linear) is passed through as it is",
        )
        children = result["children"]
        assert children[1] == "Linear", said(
            "a wholly frozen layer wrapped",
            f"after shard_layers on {said_model}, its children are {children}: a child with no parameter to"
            " train (the frozen Linear) is passed through as it is",
        )
        assert result["dtypes"] == ["float32", "float32"], said(
            "a shard not float32",
            f"after shard_layers on {said_model}, rank {rank}'s units hold shards of {result['dtypes']}: a unit's"
            " shard is float32 whatever its module's dtype",
        )
        assert not (where == "step" and "indices" in error), said(
            "integer inputs cast to the parameters' dtype",
            f"the unit of nn.Embedding(10, 6) failed on its integer inputs (torch: {error}): only the floating-point"
            " inputs are cast to the dtype of the gathered parameters; the others reach the module as they are",
        )
        assert not where, said(
            "a unit that fails on a module other than a float32 Linear",
            f"one step on {said_model} failed on rank {rank}: {error}",
        )
        for k, left in enumerate(result["full_grads"]):
            assert left == 0, said(
                "the full gradient kept after post_backward",
                f"after the backward on rank {rank}, the unit of {ODD_UNITS[k]}'s full.grad still holds {left} bytes:"
                " post_backward frees the full gradient once its piece is taken (zeroing it keeps its memory)",
            )
        for p, start in zip(result["frozen"], model[1].parameters()):
            assert torch.equal(p, start.detach()), (
                f"on rank {rank} the wholly frozen Linear(6, 7) changed: it stays as it is"
            )
    x, y = odd_batch(world_size)
    trainable = [model[0].weight, *model[3].parameters()]
    optimizer = torch.optim.Adam(trainable, lr=LR)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    for k, expected in enumerate((flat_of([model[0].weight]), flat_of(model[3].parameters()))):
        got = torch.cat([r["shards"][k] for r in results])[: ODD_SIZES[k]]
        assert torch.allclose(got, expected, rtol=0, atol=ATOL), said(
            "training a model other than a float32 Linear not one process's",
            f"after a step on {said_model}, the unit of {ODD_UNITS[k]} differs from one process by"
            f" {(got - expected).abs().max().item():.1e}",
        )


# --- Against torch's fully_shard -----------------------------------------------------------------------------


def torch_steps(steps, bf16):
    """Probe, no student code: the same Stack and batches under torch's fully_shard (each layer, then the whole), Adam; the final
    parameters, gathered."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    model = stack()
    for part in [model[i] for i in UNITS] + [model]:
        fully_shard(part, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        rank_step(stack_loss(model), optimizer, step)
    full = {name: full_tensor(p).detach().clone() for name, p in model.named_parameters()}
    return [flat_of([full[f"{i}.{n}"] for n in ("weight", "bias") if f"{i}.{n}" in full]) for i in UNITS]


def check_against_fully_shard(folder, bf16, world_size=2, steps=2):
    """ZeRO-3 by hand trains as torch's fully_shard, in float32 and in bfloat16."""
    mine = world(sharded_steps, world_size, folder, True, steps, bf16, expect=stepped(steps))
    refuse_unsharded(mine)
    theirs = reference_world(torch_steps, world_size, steps, bf16, expect=many(torch.Tensor, len(UNITS)))[0]
    precision = "bfloat16 (MixedPrecisionPolicy)" if bf16 else "float32"
    for k in range(len(UNITS)):
        got = whole(mine, steps - 1, k)
        difference = (got - theirs[k]).abs().max().item()
        assert difference <= TORCH_ATOL[bf16], (
            f"after {steps} steps in {precision} on {world_size} ranks, {unit_name(k)} differs from torch's"
            f" fully_shard by {difference:.1e} (tolerance {TORCH_ATOL[bf16]:.0e})"
        )


# --- A sharded checkpoint: saved on 2 ranks, loaded on 3 ------------------------------------------------------


def train_and_save(folder, steps):
    """Probe: ZeRO-3 steps 0 .. steps-1, then save_checkpoint into a folder of this world's; the global
    sizes the checkpoint holds, and (rank 0) its files, as bytes: the next world, of another size,
    writes them into a folder of its own (a sandboxed world writes only its own folder). (The
    metadata is read here, in a worker: it is a pickle that code under test wrote.)"""
    import torch.distributed.checkpoint as dcp

    fsdp = checkpoint_module(folder)
    model, optimizer = zero3_stack(fsdp, seed=0)
    for step in range(steps):
        rank_step(stack_loss(model), optimizer, step)
    path = [tempfile.mkdtemp(prefix="checkpoint-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)  # the ranks share the world's folder: one checkpoint, from every rank
    fsdp.save_checkpoint(model, optimizer, path[0])
    metadata = dcp.FileSystemReader(path[0]).read_metadata().state_dict_metadata
    files = {}
    if dist.get_rank() == 0:
        for name in sorted(os.listdir(path[0])):
            with open(os.path.join(path[0], name), "rb") as f:
                files[name] = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    return {"sizes": {key: list(getattr(m, "size", [])) for key, m in metadata.items()}, "files": files}


def own_flat_piece(shard, numel, mesh):
    """The tests' own flat_piece (the solution's): this rank's real elements of the shard, a DTensor of numel."""
    from torch.distributed.tensor import DTensor, Shard

    first = mesh.get_local_rank() * shard.numel()  # this rank's first element in the flat tensor
    real = shard.detach().narrow(0, 0, min(max(numel - first, 0), shard.numel()))
    return DTensor.from_local(real, mesh, placements=[Shard(0)], run_check=False, shape=(numel,), stride=(1,))


def checkpoint_module(folder):
    """fsdp.py under test, its checkpoint made of the tests' own flat_piece: the checkpoint's check judges
    checkpoint_state, saving and loading, whatever flat_piece does (test_flat_piece judges that)."""
    fsdp = load(folder).fsdp
    fsdp.flat_piece = own_flat_piece
    return fsdp


def zero3_stack(fsdp, seed):
    model = stack()
    if seed:  # another start, so that only the checkpoint can make the runs agree
        torch.manual_seed(seed)
        model = Stack()
    fsdp.shard_layers(model)
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def rank_step(loss_of, optimizer, step):
    """One step of this rank on its rows of the step's batch: loss_of(x, y) is the loss to go back from."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(CONFIG, step, world_size)
    mine = slice(rank * CONFIG.batch_size, (rank + 1) * CONFIG.batch_size)
    optimizer.zero_grad()
    loss_of(x[mine], y[mine]).backward()
    optimizer.step()


def stack_loss(model):
    return lambda x, y: F.cross_entropy(model(x).float(), y)


def load_and_train(folder, files, first, steps):
    """Probe: the checkpoint's files into a folder of this world's, a Stack from other weights,
    load_checkpoint from it, then steps first .. steps-1; this rank's shards."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    path = [tempfile.mkdtemp(prefix="checkpoint-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    if dist.get_rank() == 0:
        for name, data in files.items():
            with open(os.path.join(path[0], name), "wb") as f:
                f.write(data.numpy().tobytes())
    dist.barrier()
    path = path[0]
    fsdp = checkpoint_module(folder)
    model, optimizer = zero3_stack(fsdp, seed=1)
    try:
        fsdp.load_checkpoint(model, optimizer, path)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - whatever loading raises is the fact to report
        nothing_written(error)
        return {"load_error": f"{type(error).__name__}: {str(error)[:300]}"}
    moments = [optimizer.state[p] for p in shards_of(model)]
    shared = [
        k
        for k, state in enumerate(moments)
        if {"exp_avg", "exp_avg_sq"} <= state.keys()
        and state["exp_avg"].untyped_storage().data_ptr() == state["exp_avg_sq"].untyped_storage().data_ptr()
    ]
    for step in range(first, steps):
        rank_step(stack_loss(model), optimizer, step)
    return {"history": [[p.detach().clone() for p in shards_of(model)]], "shared": shared}


def check_checkpoint(folder, saved_on=2, loaded_on=3, steps=1):
    """Saved on 2 ranks after a step, loaded on 3, a step more: the parameters of an unbroken run."""
    # A checkpoint's pieces are DTensors (flat_piece): the checks that train judge fully_shard's
    written = world(
        train_and_save,
        saved_on,
        folder,
        steps,
        expect={"sizes": keyed(many(int)), "files": keyed(torch.Tensor)},
        allows=("DTensor",),
    )[0]
    saved = written["sizes"]
    # nan where Adam's two moments share one tensor: "shared" says so, before the numbers are compared
    history = many(many(tensor(finite=False), len(UNITS)), 1)
    loaded = either({"load_error": str}, {"history": history, "shared": many(int)})
    resumed = world(
        load_and_train, loaded_on, folder, written["files"], steps, 2 * steps, expect=loaded, allows=("DTensor",)
    )
    for k, name in enumerate(str(i) for i in UNITS):
        assert f"{name}.step" in saved, said(
            "Adam's step count not in the checkpoint",
            f"the checkpoint holds {sorted(saved)}, no '{name}.step': Adam's step count sets its bias correction,"
            " and a resumed run must go on counting",
        )
        for key in (name, f"{name}.exp_avg", f"{name}.exp_avg_sq"):
            assert key in saved, said(
                "a parameter or Adam's state missing from the checkpoint",
                f"the checkpoint holds {sorted(saved)}, no '{key}'",
            )
            assert saved[key] == [SIZES[k]], said(
                "a padded shard's size saved, not the global shape",
                f"the checkpoint saved on {saved_on} ranks holds '{key}' of size {saved[key]}; {unit_name(k)} has"
                f" {SIZES[k]}: the padding depends on W and stays out of the checkpoint (the global shape)",
            )
    error = resumed[0].get("load_error")
    assert not (error and error.startswith("KeyError")), said(
        "no state to load into for an Adam that has not stepped",
        f"loading the checkpoint into a fresh model and Adam failed ({error}): an Adam that has not stepped has no"
        " state yet; give it zeros to load into",
    )
    assert not error, said(
        "a checkpoint that does not load on another world size",
        f"loading on {loaded_on} ranks the checkpoint saved on {saved_on} failed: {error}",
    )
    for k in resumed[0].get("shared", []):
        raise AssertionError(
            said(
                "Adam's two moments one tensor",
                f"after load_checkpoint into a fresh Adam, exp_avg and exp_avg_sq of {unit_name(k)} are one tensor: the"
                " zeros checkpoint_state gave the two moments share their memory, so loading the second overwrites the"
                " first, and each step of Adam updates one through the other",
            )
        )
    model = stack()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(2 * steps):
        x, y = global_batch(CONFIG, step, saved_on if step < steps else loaded_on)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    expected = unit_flats(model)
    for k in range(len(UNITS)):
        got = whole(resumed, 0, k)
        assert torch.allclose(got, expected[k], rtol=0, atol=ATOL), (
            f"saved on {saved_on} ranks after {steps} steps, loaded on {loaded_on} and trained {steps} more,"
            f" {unit_name(k)} differs from an unbroken run by {(got - expected[k]).abs().max().item():.1e}: are"
            " the parameters and Adam's state (its step count too) all restored?"
        )


# --- The training loop's setup --------------------------------------------------------------------------------


class Layers(nn.Module):
    """Exercise 1's MLP, calling its layers (a unit needs its forward called): what setup shards."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(WIDTHS, WIDTHS[1:]))

    def forward(self, x, y):
        *hidden, last = self.layers
        for layer in hidden:
            x = torch.tanh(layer(x))
        logits = last(x)
        return logits, F.cross_entropy(logits, y)


# setup's other strategies: what a step of each gathers, and in which dtype.
SETUP_MODES = {"zero2": None, "zero3 with param_dtype=torch.bfloat16": torch.bfloat16}


def setup_steps(folder, strategy, steps):
    """Probe: setup(Layers, strategy) and `steps` steps; the sizes of what its Adam steps, and this rank's parameters.
    Then a step of each of SETUP_MODES, logged."""
    fsdp = load(folder).fsdp
    torch.manual_seed(0)
    model = Layers()
    flats = flat_sizes(fsdp, [[p] for p in model.parameters()])
    forward, optimizer = fsdp.setup(model, strategy, LR)
    stepped = [p.numel() for group in optimizer.param_groups for p in group["params"]]
    for step in range(steps):
        rank_step(lambda x, y: forward(x, y)[1], optimizer, step)
    modes = {}
    for mode, dtype in SETUP_MODES.items():
        forward, optimizer = fsdp.setup(Layers(), mode.split()[0], LR, dtype)
        with CommLog() as log:
            rank_step(lambda x, y, wrapped=forward: wrapped(x, y)[1].float(), optimizer, 0)
        modes[mode] = log.summary()
    shards = [p.detach().clone() for p in shards_of(model)]
    return {"stepped": stepped, "shards": shards, "flat_sizes": flats, "modes": modes}


def check_setup(folder, world_size=2, steps=1):
    """setup(model, 'zero3') shards the layers and returns an Adam over the shards: training equals one process."""
    results = world(
        setup_steps,
        world_size,
        folder,
        "zero3",
        steps,
        expect={
            "stepped": many(int),
            "shards": many(torch.Tensor),
            "flat_sizes": maybe(many(int)),
            "modes": keyed(SUMMARY, SETUP_MODES),
        },
    )
    torch.manual_seed(0)
    model = Layers()
    sizes = [p.numel() for p in model.parameters()]
    shards = [padded(n, world_size) // world_size for n in sizes]
    for rank, result in enumerate(results):
        if result["flat_sizes"] is not None:
            refuse_flat_shard(result["flat_sizes"], sizes, rank, world_size)
        stepped = (
            f"setup's Adam on rank {rank} steps tensors of {result['stepped']} elements; the layers' shards have"
            f" {shards}"
        )
        assert result["stepped"] != sizes, said(
            "the optimizer built before shard_layers",
            f"{stepped} and their full parameters, which no longer train, {sizes}: build the optimizer after"
            " shard_layers",
        )
        assert result["stepped"] == shards, said("setup's optimizer not over the shards", stepped)
        for mode, log in result["modes"].items():
            gathers = [d for c, d in zip(log["collectives"], log["collective_dtypes"]) if c == "all_gather_into_tensor"]
            expected = len(sizes) * (1 if mode == "zero2" else 2)
            assert len(gathers) == expected, said(
                f"setup's {mode.split()[0]} not {'ZeRO-2' if mode == 'zero2' else 'ZeRO-3'}",
                f"a step of setup(model, '{mode.split()[0]}') on rank {rank} all-gathered {len(gathers)} times for"
                f" {len(sizes)} layers, {expected} expected: "
                + (
                    "ZeRO-2 keeps each layer's gathered parameters for its backward"
                    if mode == "zero2"
                    else "ZeRO-3 frees each layer's after its forward and gathers them again for its backward"
                ),
            )
            assert mode == "zero2" or set(gathers) == {"bfloat16"}, said(
                "setup's param_dtype not passed on",
                f"a step of setup(model, 'zero3', lr, param_dtype=torch.bfloat16) on rank {rank} all-gathered"
                f" {sorted(set(gathers))}: the units gather bfloat16 copies when setup is given param_dtype",
            )
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = global_batch(CONFIG, step, world_size)
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()
    for k, p in enumerate(model.parameters()):
        got = torch.cat([r["shards"][k] for r in results])[: p.numel()]
        assert torch.allclose(got, p.detach().reshape(-1), rtol=0, atol=ATOL), (
            f"after {steps} steps of setup(model, 'zero3') on {world_size} ranks, layer {k} differs from one process"
        )


# --- The checks -------------------------------------------------------------------------------------------------


@pytest.mark.points(2)
def test_flat_shard(impl_dir):
    check_flat_shard(impl_dir)


@pytest.mark.points(1)
def test_views(impl_dir):
    check_views(impl_dir)


@pytest.mark.points(2)
def test_gather(impl_dir):
    check_gather(impl_dir)


@pytest.mark.points(2)
def test_reduce_scatter(impl_dir):
    check_reduce_scatter(impl_dir)


@pytest.mark.points(1)
@pytest.mark.parametrize("world_size", [2, 3])
def test_zero2_steps(impl_dir, world_size):
    check_steps(impl_dir, world_size, zero3=False)


@pytest.mark.points(1)
@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.points(2)), 3])
def test_zero3_steps(impl_dir, world_size):
    check_steps(impl_dir, world_size, zero3=True)


@pytest.mark.points(2)
def test_gradient_shards(impl_dir):
    check_gradient_shards(impl_dir)


@pytest.mark.points(2)
def test_sharded_bytes(impl_dir):
    check_sharded_bytes(impl_dir)


@pytest.mark.points(3)
def test_memory(impl_dir):
    check_memory(impl_dir)


@pytest.mark.points(1)
def test_zero2_keeps(impl_dir):
    check_zero2_keeps(impl_dir)


@pytest.mark.points(1)
def test_frozen(impl_dir):
    check_frozen(impl_dir)


@pytest.mark.points(1)
def test_mixed_precision(impl_dir):
    check_mixed_precision(impl_dir)


@pytest.mark.points(1)
def test_any_module(impl_dir):
    check_any_module(impl_dir)


@pytest.mark.points(1)
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16"])
def test_against_fully_shard(impl_dir, bf16):
    check_against_fully_shard(impl_dir, bf16)


@pytest.mark.points(1)
def test_flat_piece(impl_dir):
    check_flat_piece(impl_dir)


@pytest.mark.points(1)
def test_checkpoint(impl_dir):
    check_checkpoint(impl_dir)


@pytest.mark.points(2)
def test_setup(impl_dir):
    check_setup(impl_dir)
