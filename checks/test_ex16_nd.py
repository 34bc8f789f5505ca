"""Exercise 16: data x tensor parallel on a mesh of process sub-groups, against one process and torch's.

The worlds are of 4 ranks (and one of 2, for the mesh (2, 1)); each probe makes its mesh afresh in a
kept world. Which group a collective went to is taken from the process group object the collective
was called on (checks/comm_log.py), never from what the code under test says.
"""

import os
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from checks.comm_log import ALL_GATHER, ALL_REDUCE, KINDS, REDUCE_SCATTER, CommLog
from checks.helpers import PlainSGD, either, keyed, load, many, world
from course.grading.points import said
from course.memory import Gathered

# Two blocks with biases. The hidden width 8 divides by 1, 2 and 4; a row layer's block of 5 x 8 / tp
# weights and 5 biases is 25 numbers on 2 tp ranks, padded to 26 for 2 dp ranks.
WIDTHS = [6, 8, 5, 8, 3]
MESH = ("grid", "dp_rank", "tp_rank", "tp_group", "dp_group")  # what mesh_groups returns: nd.Mesh's fields
ROWS = 8  # of a batch: 1, 2 and 4 dp ranks each run a block of them
LR = 0.2
STEPS = 3
# A world of dp * tp ranks for each mesh; the degenerate ones are exercises 13 (tp 1) and 14 (dp 1).
MESHES = [(2, 2), (1, 4), (4, 1), (2, 1)]
# A hang while the groups are made (ranks that call dist.new_group for different groups) is named by the waits
# boards within seconds (course/runtime/instrument.py's Waits); one that they do not see, at this limit.
GROUPS_TIME_LIMIT = 8
# No world of these checks builds a torch optimizer (PlainSGD): grading them alone need not import torch._dynamo.
IMPORTS_DYNAMO = False


def the_mesh(dp, tp):
    """How the messages name a mesh."""
    return f"the mesh (dp {dp}, tp {tp})"


def coordinates(rank, tp):
    return rank // tp, rank % tp


def grid(dp, tp):
    return [[i * tp + j for j in range(tp)] for i in range(dp)]


def row_of(rank, dp, tp):
    return grid(dp, tp)[rank // tp]


def column_of(rank, dp, tp):
    return [row[rank % tp] for row in grid(dp, tp)]


# The groups.


def made_mesh(nd, dp, tp):
    """nd.mesh_groups(dp, tp), and this rank's dist.new_group calls (each its ranks and line) where the ranks
    called it for different groups (their own only, or in another order), else None: torch may make such
    groups of the wrong ranks, and a collective in them waits for ever, so no probe runs one."""
    calls, new_group = [], dist.new_group

    def recorded(ranks=None, *args, **kwargs):
        ranks = None if ranks is None else [int(r) for r in ranks]
        caller = sys._getframe(1)
        calls.append([ranks, f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"])
        return new_group(ranks, *args, **kwargs)

    dist.new_group = recorded
    try:
        mesh = nd.mesh_groups(dp, tp)
    finally:
        dist.new_group = new_group
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [ranks for ranks, _ in calls])
    return mesh, calls if any(other != everyone[0] for other in everyone) else None


# What a probe returns instead where the ranks made different groups (made_mesh).
CALLS = {"calls": many(many(object, 2))}


def groups_in_world(folder, dp, tp):
    """Probe: mesh_groups(dp, tp); its grid and coordinates, the members of its groups as torch knows them,
    and the ranks that each group really reached (the probe's own all-gather of the world ranks in it); or
    the rank's dist.new_group calls (made_mesh)."""
    mesh, calls = made_mesh(load(folder).nd, dp, tp)
    if calls:
        return {"calls": calls}
    if not all(hasattr(mesh, field) for field in MESH):
        return {"returned": type(mesh).__name__}
    found = {"grid": mesh.grid, "coordinates": [mesh.dp_rank, mesh.tp_rank]}
    for name, group in (("tp", mesh.tp_group), ("dp", mesh.dp_group)):
        if not isinstance(group, dist.ProcessGroup):
            found[name] = {"members": type(group).__name__, "reached": []}
            continue
        members = dist.get_process_group_ranks(group)
        reached = [torch.zeros(1, dtype=torch.int64) for _ in members]
        dist.all_gather(reached, torch.tensor([dist.get_rank()]), group=group)
        found[name] = {"members": members, "reached": [int(t) for t in reached]}
    return found


def judge_calls(mesh, results):
    """Every rank called dist.new_group for the same groups in the same order: no probe's result (by rank) is
    its calls instead (made_mesh)."""
    if not any("calls" in found for found in results):
        return
    calls = [found.get("calls", []) for found in results]
    groups = [[ranks for ranks, _ in mine] for mine in calls]
    other = next(r for r, theirs in enumerate(groups) if theirs != groups[0])

    def listed(rank):
        return ", ".join(f"{ranks} at {line}" for ranks, line in calls[rank]) or "no group"

    both = f"{mesh}: rank 0 called dist.new_group for {listed(0)}; rank {other} for {listed(other)}"
    assert sorted(map(str, groups[other])) != sorted(map(str, groups[0])), said(
        "groups created in a different order on different ranks",
        f"{both}: dist.new_group pairs each rank's calls by their order, so the ranks created their groups in"
        " different orders. Every rank creates every group, in the same order",
    )
    raise AssertionError(
        said(
            "groups created only by their members",
            f"{both}: dist.new_group is a collective of the whole world, so every rank calls it for every group,"
            " its own or not, in the same order, and keeps its own",
        )
    )


def check_groups(folder, dp, tp):
    """mesh_groups lays out the grid, gives each rank its coordinates, and puts it in the group of its row
    (tp) and of its column (dp); every group joins the ranks it names."""
    group = {"members": either(str, many(int)), "reached": many(int)}
    expect = either(
        {"returned": str},
        CALLS,
        {"grid": many(many(int)), "coordinates": many(int, 2), "tp": group, "dp": group},
    )
    results = world(groups_in_world, dp * tp, folder, dp, tp, expect=expect, timeout=GROUPS_TIME_LIMIT)
    mesh = the_mesh(dp, tp)
    judge_calls(mesh, results)
    for rank, found in enumerate(results):
        assert "returned" not in found, said(
            "mesh_groups returns no Mesh",
            f"{mesh}: mesh_groups returned a {found.get('returned')} on rank {rank}: it returns a Mesh of the grid,"
            " the rank's coordinates and its two groups",
        )
        for name in ("tp", "dp"):
            assert not isinstance(found[name]["members"], str), said(
                "a group not made",
                f"{mesh}: rank {rank}'s {name}_group is a {found[name]['members']}: a group from dist.new_group",
            )
        assert found["grid"] == grid(dp, tp), said(
            "the grid not rank r at row r // tp, column r % tp",
            f"{mesh}: mesh_groups gave the grid {found['grid']}, expected {grid(dp, tp)}: rank r at row r // tp,"
            " column r % tp, as torch's init_device_mesh lays them out",
        )
        assert found["coordinates"] == list(coordinates(rank, tp)), said(
            "a rank's coordinates not its place in the grid",
            f"{mesh}: rank {rank}'s coordinates are (dp {found['coordinates'][0]}, tp {found['coordinates'][1]}),"
            f" expected (dp {rank // tp}, tp {rank % tp}): its row and its column in the grid",
        )
        row, column = row_of(rank, dp, tp), column_of(rank, dp, tp)
        tp_members, dp_members = found["tp"]["members"], found["dp"]["members"]
        assert not (row != column and tp_members == column and dp_members == row), said(
            "the tp and dp groups swapped",
            f"{mesh}: rank {rank}'s tp group is {tp_members} and its dp group {dp_members}: swapped. The tp group"
            " is the rank's row, the ranks that split each layer; the dp group its column, the ranks that split"
            " the batch",
        )
        for name, expected in (("tp", row), ("dp", column)):
            assert found[name]["members"] == expected, said(
                "a group not the rank's row or column",
                f"{mesh}: rank {rank}'s {name} group is {found[name]['members']}, expected {expected}, its"
                f" {'row' if name == 'tp' else 'column'} of the grid",
            )
            assert found[name]["reached"] == expected, said(
                "groups created in a different order on different ranks",
                f"{mesh}: rank {rank}'s {name} group names ranks {expected} but joined ranks"
                f" {found[name]['reached']}: dist.new_group pairs each rank's calls by their order, so the ranks"
                " created their groups in different orders. Every rank creates every group, in the same order",
            )


@pytest.mark.points(1)
@pytest.mark.parametrize("dp, tp", [pytest.param(*MESHES[0], marks=pytest.mark.points(3)), *MESHES[1:]])
def test_groups(impl_dir, dp, tp):
    check_groups(impl_dir, dp, tp)


# The tests' model, and one process's numbers.


class Blocks(nn.Module):
    """Linear, tanh, Linear per block, tanh between blocks: exercise 1's MLP with biases; the same weights
    wherever it is built."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:]))

    def forward(self, x):
        *hidden, last = self.layers
        for layer in hidden:
            x = torch.tanh(layer(x))
        return last(x)


def data(step=0):
    """The batch every rank holds whole: inputs and labels."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, WIDTHS[0], generator=g), torch.randint(0, WIDTHS[-1], (ROWS,), generator=g)


def piece(layer, weight, bias, rank, dp, tp):
    """Rank r's shard of layer `layer` (a column layer at an even place, a row layer at an odd one) from one
    process's weight and bias (or their gradients): its tp block, flattened, padded to a multiple of dp, its
    dp piece."""
    i, j = coordinates(rank, tp)
    if layer % 2 == 0:
        size = weight.shape[0] // tp
        tensors = [weight[j * size : (j + 1) * size], bias[j * size : (j + 1) * size]]
    else:
        size = weight.shape[1] // tp
        tensors = [weight[:, j * size : (j + 1) * size], bias]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return F.pad(flat, (0, -flat.numel() % dp)).chunk(dp)[i]


def pieces(model, rank, dp, tp, of_grads=False):
    """Every layer's shard on rank r of the full model's parameters (or gradients), by the mesh model's names."""
    return {
        f"layers.{k}.shard": piece(
            k, *((layer.weight.grad, layer.bias.grad) if of_grads else (layer.weight, layer.bias)), rank, dp, tp
        ).detach()
        for k, layer in enumerate(model.layers)
    }


SHARDS = [f"layers.{k}.shard" for k in range(len(WIDTHS) - 1)]


def close(got, expected):
    return got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-4, atol=1e-6)


# Which collective goes to which group.


def collectives_in_world(folder, dp, tp):
    """Probe: the mesh model of the tests' model, forward on this rank's rows and backward: the collectives
    it started each way, and the world ranks of the group each went to; where the code raised after it sent a
    collective to the world, what it started until then."""
    nd = load(folder).nd
    mesh, calls = made_mesh(nd, dp, tp)
    if calls:
        return {"calls": calls}
    model = nd.MeshMLP(list(Blocks().layers), mesh)
    x = data()[0][: ROWS // dp].clone().requires_grad_()  # so that the first column layer's backward sums too
    logs = {"forward": CommLog(), "backward": CommLog()}
    try:
        with logs["forward"]:
            out = model(x)
        with logs["backward"]:
            out.sum().backward()
    except Exception:
        # A group's sizes given to the world's all-gather or reduce-scatter: gloo refuses them on every rank
        # before anything is sent. What went to the world is the mistake the judge names, not gloo's sizes.
        world_ranks = list(range(dist.get_world_size()))
        if not any(e.ranks == world_ranks for log in logs.values() for e in log.collectives()):
            raise
    return {way: [[KINDS.get(e.what, e.what), e.ranks] for e in log.collectives()] for way, log in logs.items()}


def said_list(collectives):
    counted = Counter(collectives)
    return ", ".join(f"{n} {kind}{'s' if n > 1 else ''}" for kind, n in counted.items()) or "none"


def check_collectives(folder, dp=2, tp=2):
    """The layers' all-reduces go to the rank's tp group, the all-gathers and reduce-scatters of their shards
    to its dp group, and none to the world."""
    expect = either(CALLS, dict.fromkeys(("forward", "backward"), list))
    results = world(collectives_in_world, dp * tp, folder, dp, tp, expect=expect)
    judge_calls(the_mesh(dp, tp), results)
    blocks = (len(WIDTHS) - 1) // 2
    expected = {
        "forward": Counter({ALL_GATHER: 2 * blocks, ALL_REDUCE: blocks}),
        "backward": Counter({REDUCE_SCATTER: 2 * blocks, ALL_REDUCE: blocks}),
    }
    mesh = the_mesh(dp, tp)
    for rank, found in enumerate(results):
        row, column = row_of(rank, dp, tp), column_of(rank, dp, tp)
        groups = {ALL_REDUCE: ("tp", row), ALL_GATHER: ("dp", column), REDUCE_SCATTER: ("dp", column)}
        for way in ("forward", "backward"):
            for kind, ranks in found[way]:
                if kind not in groups:
                    continue
                name, wanted = groups[kind]
                article = "an" if kind[0] == "a" else "a"
                where = f"{mesh}: rank {rank}'s {way} sent {article} {kind} to ranks {ranks}"
                assert ranks != list(range(dp * tp)), said(
                    "a collective sent to the world instead of its group",
                    f"{where}, the whole world: it belongs to the rank's {name} group, {wanted}"
                    " (pass group= to the collective)",
                )
                other = column if name == "tp" else row
                assert ranks != other, said(
                    "a collective sent to the other group",
                    f"{where}, the rank's {'dp' if name == 'tp' else 'tp'} group: it belongs to its {name} group,"
                    f" {wanted}. "
                    + (
                        "The tensor-parallel sums go to the ranks that split the layer (the row)"
                        if name == "tp"
                        else "The shards' gathers and reduce-scatters go to the ranks that hold the same block"
                        " (the column)"
                    ),
                )
                assert ranks == wanted, said(
                    "a collective sent to another group than its own",
                    f"{where}: it belongs to the rank's {name} group, {wanted}",
                )
            got = Counter(kind for kind, _ in found[way])
            assert got == expected[way], said(
                "other collectives than the layers' and the shards'",
                f"{mesh}: rank {rank}'s {way} of two blocks started {said_list(got.elements())}, expected"
                f" {said_list(expected[way].elements())}: per block, "
                + (
                    "an all-gather of each layer's shards and the row layer's all-reduce"
                    if way == "forward"
                    else "a reduce-scatter of each layer's gradient and the column layer's input gradient's all-reduce"
                ),
            )


@pytest.mark.points(4)
def test_collectives(impl_dir):
    check_collectives(impl_dir)


# Training steps against one process.


def train_in_world(folder, dp, tp, steps):
    """Probe: train_step on the mesh model of the tests' model, `steps` batches; the losses it returned, the
    rows the model ran in the first step, the shards' gradients of the first step, the shards after each
    step, and the bytes of the parameters and gradients after the first step, and of the gathered blocks
    (course/memory.py: what the all-gathers wrote into) at their peak in the first step and after it."""
    nd = load(folder).nd
    mesh, calls = made_mesh(nd, dp, tp)
    if calls:
        return {"calls": calls}
    model = nd.MeshMLP(list(Blocks().layers), mesh)
    optimizer = PlainSGD(model.parameters(), lr=LR)
    rows = []
    hook = model.register_forward_pre_hook(lambda module, args: rows.append(args[0].detach().clone()))
    losses, history, grads, held = [], [], None, None
    for step in range(steps):
        x, y = data(step)
        with Gathered() as gathered:
            losses.append(nd.train_step(model, optimizer, x, y))
        if step == 0:
            grads = {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}
            held = [sum(t.untyped_storage().nbytes() for t in ts) for ts in (model.parameters(), grads.values())]
            held += [gathered.peak_bytes(), gathered.alive_bytes()]
            hook.remove()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"losses": losses, "rows": rows, "grads": grads, "history": history, "bytes": held}


def run_steps(folder, dp, tp, steps):
    expect = {
        "losses": many(object, steps),
        "rows": many(torch.Tensor),
        "grads": keyed(object),
        "history": many(keyed(torch.Tensor), steps),
        "bytes": many(int, 4),
    }
    results = world(train_in_world, dp * tp, folder, dp, tp, steps, expect=either(CALLS, expect))
    judge_calls(the_mesh(dp, tp), results)
    return results


def judge_rows(mesh, rows, rank, dp, tp):
    """The model ran once, on the block of the batch's rows of the rank's row of the grid."""
    x, _ = data()
    i = rank // tp
    mine = x[block_of_rows(rank, dp, tp)]
    if len(rows) == 1 and torch.equal(rows[0], mine):
        return
    world_size = dp * tp
    size = ROWS // world_size
    assert not (len(rows) == 1 and torch.equal(rows[0], x[rank * size : (rank + 1) * size])), said(
        "batches split over the world instead of over dp",
        f"{mesh}: rank {rank} ran rows {rank * size}-{(rank + 1) * size - 1} of the batch of {ROWS}, its block of"
        f" {world_size} blocks: the batch splits over the dp group only, {dp} block{'s' if dp > 1 else ''} of"
        f" {ROWS // dp}, and the ranks of one tp group run the same rows (rank {rank} at row {i} of the grid runs"
        f" block {i})",
    )
    raise AssertionError(
        said(
            "the rows run not the rank's block over dp",
            f"{mesh}: train_step ran the model on {' and '.join(str(len(r)) for r in rows) or 'no'} rows on rank"
            f" {rank}, expected once on rows {i * ROWS // dp}-{(i + 1) * ROWS // dp - 1} of {ROWS}: block {i} of"
            f" {dp}, the rank's row of the grid",
        )
    )


def judge_gradient(mesh, name, got, expected, rank, dp, tp):
    """Rank r's gradient of its shard is its piece of one process's on the whole batch."""
    whose = f"{mesh}: rank {rank}'s gradient of {name}"
    assert isinstance(got, torch.Tensor), said("a gradient missing", f"{whose} is missing")
    if close(got, expected):
        return
    assert got.shape == expected.shape, said(
        "a shard's gradient of the wrong shape", f"{whose} has {got.numel()} numbers, expected {expected.numel()}"
    )
    assert not (tp > 1 and close(got * tp, expected)), said(
        "the loss scaled by 1/world instead of 1/dp",
        f"{whose} is 1/{tp} of one process's: the loss was divided by the world size {dp * tp}. The dp group's"
        f" reduce-scatter sums the shares of the batch of its {dp} rank{'s' if dp > 1 else ''}, so each rank's mean"
        f" loss is divided by dp ({dp}); the ranks of a tp group run the same rows, and are not summed",
    )
    assert not (dp > 1 and close(got, dp * expected)), said(
        "the loss not divided by dp",
        f"{whose} is {dp} times one process's: the dp group's reduce-scatter sums the ranks' gradients, and each"
        f" rank's loss is the mean over its own rows: divide it by dp ({dp})",
    )
    raise AssertionError(
        said(
            "a shard's gradient not one process's",
            f"{whose} differs from its piece of one process's on the whole batch by up to"
            f" {(got - expected).abs().max():.3g}",
        )
    )


def block_of_rows(rank, dp, tp):
    """The rows of the batch that rank r runs: block r // tp of dp."""
    i = rank // tp
    return slice(i * ROWS // dp, (i + 1) * ROWS // dp)


def near(got, expected):
    return abs(got - expected) <= 1e-5 * max(1.0, abs(expected))


def judge_loss(mesh, got, expected, own, rank, step, dp, tp):
    """train_step returned one process's loss on the batch (expected), not tp times it (the shares summed over
    the world) nor the rank's own rows' mean (own) or share of it (not summed over the dp group)."""
    if isinstance(got, float) and near(got, expected):
        return
    shown = f"{got:.6f}" if isinstance(got, float) else repr(got)
    whose = f"{mesh}: train_step returned {shown} on rank {rank} in step {step}"
    if isinstance(got, float):
        assert not (tp > 1 and near(got, tp * expected)), said(
            "the loss summed over the world instead of the dp group",
            f"{whose}, {tp} times one process's loss {expected:.6f}: the shares were summed over the world, where the"
            f" {tp} ranks of a tp group each hold the same rows' share. Sum them over the dp group only",
        )
        assert not (dp > 1 and (near(got, own) or near(got, own / dp))), said(
            "the loss not summed over the dp group",
            f"{whose}, the loss of its own rows: one process's loss {expected:.6f} is the mean over all the rows,"
            f" the sum of the {dp} ranks' shares over the dp group",
        )
    raise AssertionError(
        said(
            "train_step's loss not one process's",
            f"{whose}: one process's loss on the batch is {expected:.6f}, the mean over all its rows, and every rank"
            " returns it",
        )
    )


def check_steps(folder, dp, tp, steps=STEPS):
    """Every rank runs its dp block of the rows; train_step leaves every rank's shards the gradient of one
    process on the whole batch, returns one process's loss, and its steps train the same."""
    results = run_steps(folder, dp, tp, steps)
    full = Blocks()
    optimizer = PlainSGD(full.parameters(), lr=LR)
    mesh = the_mesh(dp, tp)
    for rank, result in enumerate(results):
        judge_rows(mesh, result["rows"], rank, dp, tp)
    for step in range(steps):
        x, y = data(step)
        optimizer.zero_grad()
        loss = F.cross_entropy(full(x), y)
        loss.backward()
        for rank, result in enumerate(results):
            if step == 0:
                assert sorted(result["grads"]) == SHARDS, said(
                    "the mesh model's parameters not one shard per layer",
                    f"{mesh}: rank {rank}'s parameters are {sorted(result['grads'])}, expected {SHARDS}",
                )
                for name, expected in pieces(full, rank, dp, tp, of_grads=True).items():
                    judge_gradient(mesh, name, result["grads"][name], expected, rank, dp, tp)
            mine = block_of_rows(rank, dp, tp)
            with torch.no_grad():
                own = F.cross_entropy(full(x[mine]), y[mine]).item()
            judge_loss(mesh, result["losses"][step], loss.item(), own, rank, step, dp, tp)
        optimizer.step()
        for rank, result in enumerate(results):
            for name, expected in pieces(full, rank, dp, tp).items():
                assert close(result["history"][step].get(name, torch.empty(0)), expected), said(
                    "shards after a step not the rank's piece of one process's",
                    f"{mesh}: after step {step}, rank {rank}'s {name} differs from its piece of one process's",
                )


@pytest.mark.points(2)
@pytest.mark.parametrize("dp, tp", [pytest.param(2, 2, marks=pytest.mark.points(4)), (1, 4), (4, 1)])
def test_steps(impl_dir, dp, tp):
    check_steps(impl_dir, dp, tp, steps=STEPS if (dp, tp) == (2, 2) else 1)


# Memory.


def check_memory(folder, dp=2, tp=2):
    """Each rank holds 1/(dp tp) of the model's parameters and of their gradients, padding included; the
    gathered blocks hold at most the rank's blocks of the layers during a step, and nothing after it."""
    results = run_steps(folder, dp, tp, 1)
    full = Blocks()
    whole = sum(p.numel() * p.element_size() for p in full.parameters())
    for rank, result in enumerate(results):
        expected = sum(t.numel() * t.element_size() for t in pieces(full, rank, dp, tp).values())
        parameters, gradients, peak, after = result["bytes"]
        mesh = the_mesh(dp, tp)
        for what, held in zip(("parameters", "gradients"), (parameters, gradients)):
            assert held == expected, said(
                f"{what} not 1/(dp tp) of the model's",
                f"{mesh}: rank {rank}'s {what} hold {held} B, expected {expected} B: its shard"
                f" of its block, about 1/{dp * tp} of the model's {whole} B",
            )
        assert after == 0, said(
            "the gathered blocks kept after the step",
            f"{mesh}: after train_step, rank {rank}'s gathered blocks still hold {after} B: a block gathered for a"
            " step is the step's alone (autograd frees it after the backward); kept on the layer, every rank holds"
            " its whole blocks between steps, and sharding over dp saves nothing",
        )
        assert peak <= dp * expected, said(
            "more gathered than the rank's blocks",
            f"{mesh}: rank {rank}'s gathered blocks held {peak} B at their peak, more than its blocks of every layer"
            f" ({dp * expected} B): an all-gather in the dp group brings dp shards of one block",
        )


@pytest.mark.points(2)
def test_memory(impl_dir):
    check_memory(impl_dir)
