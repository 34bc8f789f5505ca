"""The checks of exercise 16 catch the mistakes of a mesh of sub-groups, and a hang while its groups are made
is reported within seconds.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
mistake and shows that the check for it fails, with a message that points at the mistake.
"""

import re
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

from checks.helpers import keyed, world
from checks.test_ex16_nd import (
    ROWS,
    WIDTHS,
    Blocks,
    check_collectives,
    check_groups,
    check_memory,
    check_odd_batch,
    check_own_tensors,
    check_steps,
    data,
    piece,
    run_steps,
)
from course.launch import WorldFailed
from course.layout import SOLUTIONS
from tests import warm
from tests.mutants import assert_caught, assert_refused, assert_torch_own_caught, make_mutant, plant
from tests.own_time import Watch

ROWS_OVER_DP = '    rows = block(len(x), mesh.dp, mesh.dp_rank, "the batch\'s rows")\n'
SHARE = "    share = F.cross_entropy(model(x[rows]), y[rows]) / mesh.dp\n"
GROUPS = """    for row in grid:
        group = dist.new_group(row)
        if rank in row:
            tp_group = group
"""
BOTH = (
    GROUPS
    + """    for column in zip(*grid):
        group = dist.new_group(list(column))
        if rank in column:
            dp_group = group
"""
)

MUTANTS = {
    "Copy's backward sums over the world": (
        "        dist.all_reduce(total, group=ctx.group)\n",
        "        dist.all_reduce(total)\n",
        check_collectives,
        "rank 0's backward sent an all-reduce to ranks [0, 1, 2, 3], the whole world: it belongs to the rank's tp"
        " group, [0, 1]",
    ),
    "AllReduce sums over the world": (
        "        dist.all_reduce(total, group=group)\n",
        "        dist.all_reduce(total)\n",
        check_collectives,
        "rank 0's forward sent an all-reduce to ranks [0, 1, 2, 3], the whole world",
    ),
    "the shards all-gathered over the world": (
        "        dist.all_gather_into_tensor(full, shard.detach().contiguous(), group=group)\n",
        "        dist.all_gather_into_tensor(full, shard.detach().contiguous())\n",
        check_collectives,
        "rank 0's forward sent an all-gather to ranks [0, 1, 2, 3], the whole world: it belongs to the rank's dp"
        " group, [0, 2]",
    ),
    "the gradient reduce-scattered over the world": (
        "        dist.reduce_scatter_tensor(mine, grad.contiguous(), group=ctx.group)\n",
        "        dist.reduce_scatter_tensor(mine, grad.contiguous())\n",
        check_collectives,
        "rank 0's backward sent a reduce-scatter to ranks [0, 1, 2, 3], the whole world",
    ),
    "the row layer's sum sent to the dp group": (
        "        out = AllReduce.apply(F.linear(x, weight), self.mesh.tp_group)\n",
        "        out = AllReduce.apply(F.linear(x, weight), self.mesh.dp_group)\n",
        check_collectives,
        "rank 0's forward sent an all-reduce to ranks [0, 2], the rank's dp group: it belongs to its tp group, [0, 1]",
    ),
    "the tp and dp groups swapped": (
        BOTH,
        BOTH.replace("tp_group = group", "swap = group")
        .replace("dp_group = group", "tp_group = group")
        .replace("swap = group", "dp_group = group"),
        lambda folder: check_groups(folder, 2, 2),
        "rank 0's tp group is [0, 2] and its dp group [0, 1]: swapped",
    ),
    "the groups created in a different order on odd ranks": (
        GROUPS,
        GROUPS.replace("for row in grid:", "for row in grid if rank % 2 == 0 else grid[::-1]:"),
        lambda folder: check_groups(folder, 2, 2),
        "the ranks created their groups in different orders",
    ),
    "each rank keeps the row of its coordinates transposed": (
        BOTH,
        BOTH.replace("        if rank in row:\n", "        if row == grid[rank % dp]:\n"),
        lambda folder: check_groups(folder, 2, 2),
        "rank 1's tp_group is torch's GroupMember.NON_GROUP_MEMBER, what dist.new_group returns to a rank that is not"
        " in the group: the rank kept another row's group than its own",
    ),
    "torch's differentiable all-reduce in the row layer, and no Copy": (
        """        if self.kind == "column":
            return F.linear(Copy.apply(x, self.mesh.tp_group), weight, *bias)
        out = AllReduce.apply(F.linear(x, weight), self.mesh.tp_group)
""",
        """        if self.kind == "column":
            return F.linear(x, weight, *bias)
        out = torch.distributed.nn.functional.all_reduce(F.linear(x, weight), group=self.mesh.tp_group)
""",
        lambda folder: check_steps(folder, 2, 2, steps=1),
        "the mesh model alone, without train_step (the sum of its outputs, backward), left rank 0 2 times its piece"
        " of one process's gradient of layers.0.shard: the layers' backward sums over the tp group once more",
    ),
    "the shard's gradient all-reduced over the dp group, then cut": (
        """        mine = grad.new_empty(grad.numel() // dist.get_world_size(ctx.group))
        dist.reduce_scatter_tensor(mine, grad.contiguous(), group=ctx.group)
        return mine, None
""",
        """        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)].clone(), None
""",
        check_collectives,
        "rank 0's backward sent 4 all-reduces to its dp group [0, 2] and 4 reduce-scatters fewer than the layers'"
        " shards take: the shard's gradient is this rank's piece of the dp group's sum",
    ),
    "AllReduce sums into its input": (
        """        total = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total
""",
        """        dist.all_reduce(x, group=group)
        return x
""",
        check_own_tensors,
        "on rank 0, AllReduce's forward changed the input it was given in place: it returns a tensor of its own",
    ),
    "Copy's backward sums into the gradient it was given": (
        """        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=ctx.group)
        return total, None
""",
        """        dist.all_reduce(grad, group=ctx.group)
        return grad, None
""",
        check_own_tensors,
        "on rank 0, Copy's backward changed the gradient it was given in place: it returns a tensor of its own",
    ),
    "GatherShards' backward reduce-scatters into the gradient it was given": (
        "        mine = grad.new_empty(grad.numel() // dist.get_world_size(ctx.group))\n",
        "        mine = grad.view(dist.get_world_size(ctx.group), -1)[dist.get_rank(ctx.group)]\n",
        check_own_tensors,
        "GatherShards's backward changed the gradient it was given in place",
    ),
    "GatherShards' forward gathers into a float32 buffer whatever the shard's dtype": (
        "        full = shard.new_empty(shard.numel() * dist.get_world_size(group))\n",
        "        full = torch.empty(shard.numel() * dist.get_world_size(group))\n",
        check_own_tensors,
        "GatherShards's forward raised RuntimeError: ProcessGroupGloo::allgather: invalid tensor type",
    ),
    "GatherShards' backward reduce-scatters into a float32 buffer": (
        "        mine = grad.new_empty(grad.numel() // dist.get_world_size(ctx.group))\n",
        "        mine = torch.zeros(grad.numel() // dist.get_world_size(ctx.group))\n",
        check_own_tensors,
        "GatherShards's backward raised RuntimeError",
    ),
    "Copy's backward sums a float32 copy": (
        "        total = grad.clone(memory_format=torch.contiguous_format)\n",
        "        total = grad.float().clone()\n",
        check_own_tensors,
        "on rank 0, Copy's backward returned a float32 tensor for a float64 gradient",
    ),
    "a batch that dp does not divide split by chunk": (
        ROWS_OVER_DP + SHARE,
        "    xs, ys = x.chunk(mesh.dp)[mesh.dp_rank], y.chunk(mesh.dp)[mesh.dp_rank]\n"
        "    share = F.cross_entropy(model(xs), ys) / mesh.dp\n",
        check_odd_batch,
        "train_step on a batch of 7 rows, which dp 2 does not divide, returned 1.039931 on rank 0, where one process's"
        " loss on it is 1.056476",
    ),
    "a batch that dp does not divide refused with words that name neither": (
        ROWS_OVER_DP,
        "    if len(x) % mesh.dp:\n        raise ValueError('uneven')\n" + ROWS_OVER_DP,
        check_odd_batch,
        "raised ValueError('uneven') on rank 0: the error names the batch's rows (7) and dp (2)",
    ),
    "the grid laid out by columns": (
        "    grid = [[i * tp + j for j in range(tp)] for i in range(dp)]\n",
        "    grid = [[j * dp + i for j in range(tp)] for i in range(dp)]\n",
        lambda folder: check_groups(folder, 2, 2),
        "expected [[0, 1], [2, 3]]: rank r at row r // tp",
    ),
    "the batch split over the world instead of over dp": (
        ROWS_OVER_DP,
        ROWS_OVER_DP.replace("mesh.dp, mesh.dp_rank", "dist.get_world_size(), dist.get_rank()"),
        lambda folder: check_steps(folder, 2, 2, steps=1),
        "the batch splits over the dp group only, 2 blocks of 4",
    ),
    "the loss scaled by 1/world instead of 1/dp": (
        SHARE,
        SHARE.replace("mesh.dp", "dist.get_world_size()"),
        lambda folder: check_steps(folder, 2, 2, steps=1),
        "is 1/2 of one process's: the loss was divided by the world size 4",
    ),
    "the loss not divided by dp": (
        SHARE,
        SHARE.replace(" / mesh.dp", ""),
        lambda folder: check_steps(folder, 4, 1, steps=1),
        "is 4 times one process's: the dp group's reduce-scatter sums",
    ),
    "the loss summed over the world": (
        "    dist.all_reduce(loss, group=mesh.dp_group)\n",
        "    dist.all_reduce(loss)\n",
        lambda folder: check_steps(folder, 2, 2, steps=1),
        "2 times one process's loss 1.023011: the shares were summed over the world",
    ),
    "the loss not summed over the dp group": (
        "    dist.all_reduce(loss, group=mesh.dp_group)\n",
        "",
        lambda folder: check_steps(folder, 2, 2, steps=1),
        "on rank 0 in step 0: its own rows' share (their mean / dp), not summed over the dp group. One process's"
        " loss 1.023011 is the mean over all the rows",
    ),
    "the loss summed over the tp group": (
        "    dist.all_reduce(loss, group=mesh.dp_group)\n",
        "    dist.all_reduce(loss, group=mesh.tp_group)\n",
        lambda folder: check_steps(folder, 2, 2, steps=1),
        "its own rows' share summed over its tp group, whose 2 ranks hold the same share; or the mean of its own rows"
        " alone. One process's loss 1.023011",
    ),
    "the loss summed over the tp group, where tp is 1": (
        "    dist.all_reduce(loss, group=mesh.dp_group)\n",
        "    dist.all_reduce(loss, group=mesh.tp_group)\n",
        lambda folder: check_steps(folder, 4, 1, steps=1),
        "its own rows' share (their mean / dp), not summed over the dp group",
    ),
    "a mean loss that is no loss of the batch": (
        SHARE,
        SHARE + "    share = share + 1\n",
        lambda folder: check_steps(folder, 4, 1, steps=1),
        "train_step returned",
    ),
    "the gathered block kept on the layer": (
        "        full = GatherShards.apply(self.shard, self.mesh.dp_group)\n",
        "        self.kept = full = GatherShards.apply(self.shard, self.mesh.dp_group)\n",
        check_memory,
        "after train_step, rank 0's gathered blocks still hold",
    ),
    "the reduce-scatter's piece kept whole": (
        "        self.shard = nn.Parameter(padded.chunk(mesh.dp)[mesh.dp_rank].clone())\n",
        "        self.shard = nn.Parameter(padded.clone())\n",
        check_memory,
        "rank 0's parameters hold",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, "nd.py", *MUTANTS[mistake])


def test_a_mistake_in_the_groups_costs_the_groups_checks_alone(tmp_path):
    """The probes of the layers, of train_step and of memory run on the judge's mesh: groups created in a
    different order on odd ranks fail test_groups, and nothing else."""
    old, new, check, hint = MUTANTS["the groups created in a different order on odd ranks"]
    folder = make_mutant(tmp_path / "mutant", "nd.py", old, new)
    with pytest.raises(AssertionError, match=re.escape(hint)):
        check(folder)
    for other in (check_collectives, check_memory, check_own_tensors, check_odd_batch):
        other(folder)
    check_steps(folder, 2, 2, steps=1)


GATHER_INTO_ONE = """        full = shard.new_empty(shard.numel() * dist.get_world_size(group))
        dist.all_gather_into_tensor(full, shard.detach().contiguous(), group=group)
"""
GATHER_A_LIST = """        pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, shard.detach().contiguous(), group=group)
        full = torch.cat(pieces)
"""
KEEP = (
    "        full = GatherShards.apply(self.shard, self.mesh.dp_group)\n",
    "        self.kept = full = GatherShards.apply(self.shard, self.mesh.dp_group)\n",
)


def test_the_list_form_of_the_all_gather_is_held_to_the_same_memory(tmp_path):
    """dist.all_gather into a list, then a cat: correct, it passes the memory check; with the block kept on the
    layer, the check names where it is kept, as it does for all_gather_into_tensor."""
    folder = make_mutant(tmp_path / "list", "nd.py", GATHER_INTO_ONE, GATHER_A_LIST)
    check_memory(folder)
    check_steps(folder, 2, 2, steps=1)
    plant(folder, "nd.py", *KEEP)
    with pytest.raises(AssertionError, match=r"after train_step, rank 0's layers hold layers\.0\.kept \(\d+ B\)"):
        check_memory(folder)


# Correct programs that make their groups otherwise than the reference: each as torch allows.
GROUPS_OTHERWISE = {
    "by their members only (use_local_synchronization)": "    tp_group = dist.new_group(grid[rank // tp], use_local_synchronization=True)\n"
    "    dp_group = dist.new_group([row[rank % tp] for row in grid], use_local_synchronization=True)\n",
    "from generators of ranks": BOTH.replace("dist.new_group(row)", "dist.new_group(r for r in row)").replace(
        "dist.new_group(list(column))", "dist.new_group(r for r in column)"
    ),
}


@pytest.mark.parametrize("how", sorted(GROUPS_OTHERWISE))
def test_groups_made_otherwise_as_torch_allows_pass_and_train(tmp_path, how):
    folder = make_mutant(tmp_path / "mutant", "nd.py", "    tp_group = dp_group = None\n" + BOTH, GROUPS_OTHERWISE[how])
    for dp, tp in ((2, 2), (1, 4), (4, 1), (2, 1)):
        check_groups(folder, dp, tp)
    small = ["--dim-in", "16", "--n-classes", "4", "--dim-hidden", "8", "--train-size", "200", "--batch-size", "8"]
    done = warm.run(["nd.py", "--dp", "2", "--tp", "2", *small, "--niters", "5"], cwd=folder)
    assert done.returncode == 0, done.stderr


def test_groups_made_by_their_members_only_are_named_within_3_s(tmp_path, capfd):
    """Each rank calls dist.new_group for its own two groups only. In torch 2.13 the ranks then wait for one
    another in new_group, or some return and wait in the check's all-gather of their calls, or all return with
    groups in which a collective waits for ever: the check names the mistake and the student's lines, from the
    world's report within 3 s of the last rank blocking (the first two: the waits boards, issue 49, not the
    groups check's time limit) or from each rank's calls (the third, before any collective in them). The
    mutant prints the time before each call that may block: the last rank blocked after the latest."""
    may_block = '    print(f"rank {rank} may block at {time.time()!r}", flush=True)\n'
    own = (
        may_block
        + "    tp_group = dist.new_group(grid[rank // tp])\n"
        + may_block
        + "    dp_group = dist.new_group([row[rank % tp] for row in grid])\n"
        + may_block
        + "    return Mesh(grid, rank // tp, rank % tp, tp_group, dp_group)\n"
    )
    start = "    tp_group = dp_group = None\n"
    with open(f"{SOLUTIONS}/nd.py") as f:
        source = f.read()
    old = source[source.index(start) : source.index("    return Mesh(grid", source.index(start))]
    old += "    return Mesh(grid, rank // tp, rank % tp, tp_group, dp_group)\n"
    folder = make_mutant(tmp_path / "mutant", "nd.py", old, own)
    with Watch() as watch, pytest.raises((WorldFailed, AssertionError)) as caught:
        check_groups(folder, 2, 2)
    reported = time.time()
    blocked = [float(t) for t in re.findall(r"may block at (\S+)", capfd.readouterr().out)]
    failure = getattr(caught.value, "failure", None)
    report = failure.report() if failure is not None else str(caught.value)
    assert re.search(r"(waits in new_group at|\] at) nd\.py:\d+", report), report
    assert "for every group, its own or not, in the same order" in report, report
    assert len(blocked) >= 4, blocked
    after = watch.own_between(max(blocked), reported)  # in the world's own time, as the waits boards count
    assert after < 3, f"the hang was reported {after:.1f} s of the world's own time after the last block"


def test_the_script_trains_as_one_process():
    """`python nd.py --dp 2 --tp 2`: the loss on the mesh is one process's, and every rank says where it is."""
    small = ["--dim-in", "16", "--n-classes", "4", "--dim-hidden", "8", "--train-size", "200", "--batch-size", "8"]
    done = warm.run(["nd.py", "--dp", "2", "--tp", "2", *small, "--niters", "20"], cwd=SOLUTIONS)
    assert done.returncode == 0, done.stderr
    final = re.search(r"train_loss ([\d.]+) \| one process ([\d.]+)", done.stdout.splitlines()[-6])
    assert final and final[1] == final[2], done.stdout
    for rank in range(4):
        assert f"rank {rank} at (dp {rank // 2}, tp {rank % 2}): parameters" in done.stdout, done.stdout


def torch_composition(dp, tp):
    """Probe, no student code: torch's composition on the tests' model, one step's gradients, each whole on
    every rank. init_device_mesh's groups, the tp dimension by ColwiseParallel and RowwiseParallel, the dp
    dimension by fully_shard, each dp rank on its block of the rows (fully_shard averages over dp)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = Blocks()
    plan = {f"layers.{k}": (ColwiseParallel() if k % 2 == 0 else RowwiseParallel()) for k in range(len(model.layers))}
    fully_shard(parallelize_module(model, mesh["tp"], plan), mesh=mesh["dp"])
    x, y = data()
    i = mesh["dp"].get_local_rank()
    rows = slice(i * ROWS // dp, (i + 1) * ROWS // dp)
    F.cross_entropy(model(x[rows]), y[rows]).backward()
    with warnings.catch_warnings():  # that the strided shard's redistribution takes two all-gathers
        warnings.simplefilter("ignore")
        return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def test_the_reference_trains_as_torchs_composition():
    """The checks grade against one process; torch's own composition of tensor parallelism (over mesh["tp"]) and
    fully_shard (over mesh["dp"]) on a (2, 2) mesh gives one process's gradients too, and every shard of the
    reference's gradients is its piece of torch's. Not a graded check: torch's first step costs seconds in
    each of 4 ranks, more than a grade's whole budget, and it adds nothing one process does not judge."""
    dp, tp = 2, 2
    theirs = world(torch_composition, dp * tp, dp, tp, expect=keyed(torch.Tensor))
    ours = run_steps(SOLUTIONS, dp, tp, 1)
    for rank, (got, grads) in enumerate(zip(ours, theirs)):
        for k in range(len(WIDTHS) - 1):
            expected = piece(k, grads[f"layers.{k}.weight"], grads[f"layers.{k}.bias"], rank, dp, tp)
            assert torch.allclose(got["grads"][f"layers.{k}.shard"], expected, atol=1e-7), (rank, k)


def test_the_script_refuses_a_world_size_that_is_not_the_mesh():
    assert_refused("nd.py", ["--world-size", "3", "--dp", "2", "--tp", "2"], "--world-size 3 is not --dp 2 x --tp 2")


def test_the_script_refuses_layers_that_do_not_pair():
    assert_refused("nd.py", ["--n-layers", "1"], "--n-layers 1: the layers pair up")


# Issue 47: the sum over a group's ranks as torch's DTensor makes it on that group's mesh (torch's way to this
# exercise: a DeviceMesh, parallelize_module, fully_shard): right values, and the kernel's count of DTensor's C++
# constructor and dispatch tells.
TORCH_OWN = (
    "nd.py",
    "        total = x.clone(memory_format=torch.contiguous_format)\n"
    "        dist.all_reduce(total, group=group)\n"
    "        return total\n",
    "        from torch.distributed.device_mesh import DeviceMesh\n"
    "        from torch.distributed.tensor import DTensor, Partial, Replicate\n"
    "\n"
    '        mesh = DeviceMesh.from_group(group, "cpu")\n'
    "        partial = DTensor.from_local(x.contiguous(), mesh, [Partial()], run_check=False)\n"
    "        return partial.redistribute(placements=[Replicate()]).to_local().clone()\n",
    lambda folder: check_steps(folder, 2, 2, steps=1),
    "DTensor",
)


def test_torch_own_dtensor_is_caught(tmp_path, monkeypatch):
    assert_torch_own_caught(tmp_path / "mutant", "the sum as a DTensor's", *TORCH_OWN, monkeypatch)
