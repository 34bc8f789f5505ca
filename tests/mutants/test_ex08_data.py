"""The checks of exercise 8 catch the mistakes of partitions and uneven shards, the reference notebook's among them.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
mistake and shows that the check for it fails, with a message that points at the mistake.
"""

import pytest
import torch
from torch.utils.data import DistributedSampler

from checks.test_ex08_data import (
    check_against_sampler,
    check_agreed_steps,
    check_join,
    check_partition,
    check_shard_sizes,
    check_unbalanced_hang,
    check_weighted_average,
)
from course.layout import SOLUTIONS
from tests.mutants import assert_caught, assert_refused, make_mutant

LEFT_OVERS = "    for k in by_remainder[: n - sum(sizes)]:\n        sizes[k] += 1\n"
DDP_LOOP = """    wrapped = DDP(model)
    with Join([wrapped]):
        for step in range(steps):"""

MUTANTS = {
    "a frozen parameter's missing gradient not skipped": (
        "data.py",
        "        if param.grad is not None:\n            param.grad.mul_(rows / n.item())\n"
        "            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)\n",
        "        param.grad.mul_(rows / n.item())\n        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)\n",
        lambda folder: check_weighted_average(folder, 2),
        "raised AttributeError: 'NoneType' object has no attribute 'mul_' on rank 0 for a model whose first layer is"
        " frozen",
    ),
    # int(n * f) for each: 10 samples by thirds make shards of 3, 3 and 3, and one sample is lost.
    "left-over samples dropped": (
        "data.py",
        LEFT_OVERS,
        "",
        check_shard_sizes,
        "must add up to n",
    ),
    "every size rounded to the nearest": (
        "data.py",
        "sizes = [math.floor(x) for x in exact]",
        "sizes = [round(x) for x in exact]",
        check_shard_sizes,
        "must add up to n",
    ),
    "left-overs to the last rank": (
        "data.py",
        LEFT_OVERS,
        "    sizes[-1] += n - sum(sizes)\n",
        check_shard_sizes,
        "the largest fractional parts",
    ),
    "ties broken towards the higher rank": (
        "data.py",
        "key=lambda k: (-(exact[k] - sizes[k]), k)",
        "key=lambda k: (-(exact[k] - sizes[k]), -k)",
        check_shard_sizes,
        "the lower rank first among equal ones",
    ),
    # Its own sizes, the left-overs to the last shard, instead of shard_sizes.
    "partition sizes its shards itself": (
        "data.py",
        "    return list(order.split(shard_sizes(n, fractions)))",
        "    sizes = [int(n * f) for f in fractions[:-1]]\n    return list(order.split([*sizes, n - sum(sizes)]))",
        check_partition,
        "cut pieces of shard_sizes(n, fractions)",
    ),
    # The right sizes as floats: torch's split refuses them, and so does a check of whole numbers.
    "sizes returned as floats": (
        "data.py",
        "    return sizes\n    ### END SOLUTION",
        "    return [float(s) for s in sizes]\n    ### END SOLUTION",
        check_shard_sizes,
        "return a list of ints",
    ),
    # Right while one sample is left over; with two (10 samples by quarters), one shard gets both.
    "all left-overs to the largest fractional part": (
        "data.py",
        LEFT_OVERS,
        "    sizes[by_remainder[0]] += n - sum(sizes)\n",
        check_shard_sizes,
        "rounded down or up",
    ),
    "shuffled with another seed": (
        "data.py",
        "order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))",
        "order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))",
        check_partition,
        "cut into consecutive pieces in rank order",
    ),
    "pieces in reverse rank order": (
        "data.py",
        "    return list(order.split(shard_sizes(n, fractions)))",
        "    return list(order.flip(0).split(shard_sizes(n, fractions)[::-1]))[::-1]",
        check_partition,
        "cut into consecutive pieces in rank order",
    ),
    # Indices drawn with replacement: some twice, some never.
    "indices drawn with replacement": (
        "data.py",
        "order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))",
        "order = torch.randint(max(n, 1), (n,), generator=torch.Generator().manual_seed(seed))",
        check_partition,
        "exactly one shard",
    ),
    "shards not shuffled": (
        "data.py",
        "order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))",
        "order = torch.arange(n)",
        check_partition,
        "did not shuffle",
    ),
    # The global generator: a different order on every rank, so shards overlap and miss samples.
    "shuffled with the global generator": (
        "data.py",
        "order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))",
        "order = torch.randperm(n)",
        check_partition,
        "differ from rank 0's",
    ),
    # The same shards on every rank, but the global generator reseeded: what the handout forbids.
    "shuffled after torch.manual_seed": (
        "data.py",
        "order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))",
        "torch.manual_seed(seed)\n    order = torch.randperm(n)",
        check_partition,
        "changed rank 0's global random generator",
    ),
    # Right shards on every rank, but by communication, which the seed makes unnecessary.
    "rank 0's order broadcast": (
        "data.py",
        "    return list(order.split(shard_sizes(n, fractions)))",
        "    dist.broadcast(order, src=0)\n    return list(order.split(shard_sizes(n, fractions)))",
        check_partition,
        "no communication",
    ),
    # DistributedSampler's way: disjoint and covering, but dealt out, not cut into pieces.
    "shards dealt like cards": (
        "data.py",
        "    return list(order.split(shard_sizes(n, fractions)))",
        "    return [order[k :: len(fractions)] for k in range(len(fractions))]",
        check_against_sampler,
        "consecutive pieces",
    ),
    # The reference notebook's average: right only when every rank's batch is as large.
    "plain mean instead of m_k / n": (
        "data.py",
        "param.grad.mul_(rows / n.item())",
        "param.grad.div_(dist.get_world_size())",
        lambda folder: check_weighted_average(folder, 2),
        "weight rank k's gradient by m_k / n",
    ),
    # n = m_k: the weights add up to the world size, not 1 (n = m_k * W would be the plain mean again).
    "row counts not all-reduced": (
        "data.py",
        "dist.all_reduce(n, op=dist.ReduceOp.SUM)",
        "pass",
        lambda folder: check_weighted_average(folder, 3),
        "not the gradient of the union batch",
    ),
    # Nothing to wait for: the ranks with fewer batches leave, and the run ends.
    "the weighted average communicates nothing": (
        "data.py",
        "    n = torch.tensor([float(rows)])\n    dist.all_reduce(n, op=dist.ReduceOp.SUM)\n"
        "    for param in model.parameters():\n        if param.grad is not None:\n"
        "            param.grad.mul_(rows / n.item())\n            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)\n",
        "    pass\n",
        check_unbalanced_hang,
        "the run ended",
    ),
    # An error at a line of common_steps is reported as that error, not as ranks that disagree.
    "an error in common_steps": (
        "data.py",
        "dist.all_reduce(agreed, op=dist.ReduceOp.MIN)",
        "dist.all_reduce(agreed, op=dist.ReduceOp.MINIMUM)",
        lambda folder: check_agreed_steps(folder, 2),
        "AttributeError",
    ),
    "common_steps returns a tensor": (
        "data.py",
        "    return int(agreed.item())",
        "    return agreed[0]",
        lambda folder: check_agreed_steps(folder, 2),
        "as an int",
    ),
    "ranks agree on the largest number of steps": (
        "data.py",
        "dist.all_reduce(agreed, op=dist.ReduceOp.MIN)",
        "dist.all_reduce(agreed, op=dist.ReduceOp.MAX)",
        lambda folder: check_agreed_steps(folder, 2),
        "should take the smallest number",
    ),
    "each rank keeps its own number of steps": (
        "data.py",
        "dist.all_reduce(agreed, op=dist.ReduceOp.MIN)",
        "pass",
        lambda folder: check_agreed_steps(folder, 2),
        "common_steps should return the same number on every rank",
    ),
    "DDP without Join": (
        "data.py",
        DDP_LOOP,
        DDP_LOOP.replace("with Join([wrapped]):", "if True:"),
        check_join,
        "inside `with Join([ddp_model]):`",
    ),
    # Join passes its keyword arguments to DDP's join hook: the late steps are then divided by fewer ranks.
    "late steps divided by the ranks still training": (
        "data.py",
        "with Join([wrapped]):",
        "with Join([wrapped], divide_by_initial_world_size=False):",
        check_join,
        "DDP under Join divides by the world size",
    ),
    # DDP's forward pass never runs: its reducer is not prepared, and Join sees no step of this rank.
    "loop calls the model, not the DDP model": (
        "data.py",
        "_, loss = wrapped(X[rows], Y[rows])",
        "_, loss = model(X[rows], Y[rows])",
        check_join,
        "call the DDP model in the loop, not `model`",
    ),
    # The loop is inside Join; the extra average has no partner once a rank has run out of batches.
    "a hand-written average inside Join": (
        "data.py",
        "            loss.backward()\n            optimizer.step()\n    ### END SOLUTION",
        "            loss.backward()\n            for p in model.parameters():\n                dist.all_reduce(p.grad)\n"
        "                p.grad /= dist.get_world_size()\n            optimizer.step()\n    ### END SOLUTION",
        check_join,
        "started collectives of its own",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])


def test_partition_is_judged_apart_from_shard_sizes(tmp_path):
    """A wrong shard_sizes costs the check of shard_sizes, not those of partition, which calls it."""
    folder = make_mutant(tmp_path / "mutant", "data.py", LEFT_OVERS, "    sizes[-1] += n - sum(sizes)\n")
    with pytest.raises(AssertionError, match="the largest fractional parts"):
        check_shard_sizes(folder)
    check_partition(folder)
    check_against_sampler(folder)


def test_distributed_sampler_pads_with_the_first_samples_or_drops_the_last():
    """The handout's account of DistributedSampler: it deals its shuffled order like cards, repeats the first
    samples of the order until every rank has ceil(n / W), or with drop_last=True keeps floor(n / W) each."""
    n, w, seed = 10, 3, 5
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    padded = [list(DistributedSampler(range(n), num_replicas=w, rank=r, shuffle=True, seed=seed)) for r in range(w)]
    assert [padded[i % w][i // w] for i in range(12)] == order + order[:2]
    dropped = [
        list(DistributedSampler(range(n), num_replicas=w, rank=r, shuffle=True, seed=seed, drop_last=True))
        for r in range(w)
    ]
    assert [len(d) for d in dropped] == [3, 3, 3] and sorted(sum(dropped, [])) == sorted(order[:9])


@pytest.mark.parametrize(
    "args, words",
    [
        (["--world-size", "0"], "'0' is not a whole number of at least 1"),
        (["--fractions", "1.0", "0.0"], "2 positive numbers that add up to 1"),
        (["--fractions", "0.5", "0.6"], "2 positive numbers that add up to 1"),
        (["--fractions", "0.5", "0.3", "0.2"], "2 positive numbers"),
        (["--fractions", "0.95", "0.05", "--batch-size", "8"], "would hold no row"),
        (["--device", "cuda"], "--device cpu"),
        (["--uneven", "sometimes"], "invalid choice"),
    ],
)
def test_bad_arguments_are_refused(args, words):
    assert_refused("data.py", args, words)


def test_common_steps_is_judged_apart_from_the_weighted_average(tmp_path):
    folder = make_mutant(tmp_path / "mutant", "data.py", "param.grad.mul_(rows / n.item())", "pass")
    with pytest.raises(AssertionError, match="not the gradient of the union batch"):
        check_weighted_average(folder, 2)
    check_agreed_steps(folder, 2)


def test_counts_gathered_instead_of_reduced_are_right(tmp_path):
    """n from an all-gather of the counts is as right as from an all-reduce: the hang is still a hang, named
    in data.py, and the gradients are the union batch's."""
    folder = make_mutant(
        tmp_path / "mutant",
        "data.py",
        "    n = torch.tensor([float(rows)])\n    dist.all_reduce(n, op=dist.ReduceOp.SUM)\n",
        "    counts = [torch.zeros(1) for _ in range(dist.get_world_size())]\n"
        "    dist.all_gather(counts, torch.tensor([float(rows)]))\n    n = sum(counts)\n",
    )
    check_unbalanced_hang(folder)
    check_weighted_average(folder, 3)


def test_the_hang_found_before_the_graders_clock_runs_out_pays(monkeypatch):
    """Under load (4 busy loops beside others' work on 2 cores) the ranks had not reached the hang within the first
    limit, and the next one, longer, let the parent find the deadlock first (every rank waiting, unchanged, where
    none can move): the reference lost its 2 points to "it ended". With a limit no machine reaches, the hang is that
    finding."""
    from checks import test_ex08_data

    monkeypatch.setattr(test_ex08_data, "HANG_LIMITS", (60,))
    check_unbalanced_hang(SOLUTIONS)


def test_a_rank_a_collective_behind_is_looked_at_again():
    """The reference's hang, once under the suite's load (runs 16, 42 and 49 of issue 49): at the first limit rank 0 waited
    in its 7th step's all-reduce while rank 1 was still in its 6th's, which rank 0 had passed. Rank 1 can still end:
    the check looks again, longer (Failure.on_its_way), and judges the hang only where no rank can move."""
    from course.runtime.failure import RankFact, timed_out

    def waiting(rank, number, call="all_reduce", file="data.py"):
        return RankFact(rank, "waited", file=file, collective=call, instance=(0, number, call, None))

    assert timed_out([waiting(0, 7), waiting(1, 6)], 2, 1).on_its_way(), "rank 1 a collective behind"
    assert timed_out([waiting(0, 7), waiting(1, 7)], 2, 1).on_its_way(), "both in one collective"
    # Run 49: rank 1's stack showed its all-reduce, and its board, read after, another moment.
    moving = RankFact(1, "waited", file="data.py", collective="all_reduce", moved=True)
    assert timed_out([waiting(0, 7), moving], 2, 1).on_its_way(), "rank 1 moved while it was looked at"
    # Run 69: at the 1 s limit a loaded machine had not yet started rank 1, which waited to join the world.
    joining = RankFact(1, "waited", collective="init_process_group", judged=True)
    assert timed_out([waiting(0, 7), joining], 2, 1).on_its_way(), "rank 1 still joining the world"
    hang = timed_out([waiting(0, 7), waiting(1, 7, "barrier", "worker.py")], 2, 1)
    assert not hang.on_its_way(), "rank 1 done, in the launcher's barrier: the hang"
