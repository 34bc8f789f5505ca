"""The checks of exercise 11 catch the mistakes of a sharded optimizer and of a bfloat16 comm hook.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
mistake and shows that the check for it fails, with a message that points at the mistake.

A broadcast whose source differs across ranks (src=rank, say) is named at once: the ranks compare
each collective's root before it starts (course/runtime/instrument.py). "Broadcast from the wrong rank" is
the same source on every rank, rank 0's, which returns wrong values instead.
"""

import pytest

from checks.test_ex11_zero import check_hook, check_owners, check_state_bytes, check_steps
from course.layout import SOLUTIONS
from tests.mutants import assert_caught, assert_refused, assert_torch_own_caught, make_mutant

LEAST_LOADED = "        rank = load.index(min(load))\n"
SENT = "    started = dist.all_reduce(compressed, group=group, async_op=True).get_future()\n"

MUTANTS = {
    "every rank steps every parameter (no sharding)": (
        "zero.py",
        "        self.optimizer = optimizer_class(mine, **defaults)",
        "        self.optimizer = optimizer_class(self.params, **defaults)",
        lambda folder: check_state_bytes(folder, 2),
        "must see only the parameters rank 0 owns",
    ),
    "every parameter owned by rank 0": (
        "zero.py",
        LEAST_LOADED,
        "        rank = 0\n",
        check_owners,
        "balance the ranks by size",
    ),
    # Owners of its own, by position, instead of self.owners: the state no longer lies where the owners say.
    "the wrapped optimizer's parameters taken by position": (
        "zero.py",
        "        mine = [p for p, owner in zip(self.params, self.owners) if owner == dist.get_rank()]",
        "        mine = self.params[dist.get_rank() :: dist.get_world_size()]",
        lambda folder: check_state_bytes(folder, 2),
        "its wrapped optimizer sees exactly those",
    ),
    "parameters in their order, not largest first": (
        "zero.py",
        "    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):",
        "    for i in range(len(sizes)):",
        check_owners,
        "largest first",
    ),
    "a tie to the higher rank": (
        "zero.py",
        LEAST_LOADED,
        "        rank = len(load) - 1 - load[::-1].index(min(load))\n",
        check_owners,
        "a tie to the lower rank",
    ),
    "owners counted from 1": (
        "zero.py",
        "        owners[i] = rank\n",
        "        owners[i] = rank + 1\n",
        check_owners,
        "every owner is a rank in range",
    ),
    "equal sizes taken last first": (
        "zero.py",
        "key=lambda i: -sizes[i]",
        "key=lambda i: (-sizes[i], -i)",
        check_owners,
        "equal sizes in their order",
    ),
    # Adam with its default learning rate (1e-3), not the lr the checks pass.
    "the optimizer's arguments dropped": (
        "zero.py",
        "        self.optimizer = optimizer_class(mine, **defaults)",
        "        self.optimizer = optimizer_class(mine)",
        lambda folder: check_steps(folder, 2, steps=1),
        "differs from Adam in one process",
    ),
    # Right for the Adam of train(); ShardedOptimizer wraps whichever optimizer it is given.
    "the wrapped optimizer always Adam": (
        "zero.py",
        "        self.optimizer = optimizer_class(mine, **defaults)",
        '        self.optimizer = torch.optim.Adam(mine, lr=defaults["lr"])',
        lambda folder: check_steps(folder, 2, "sgd_momentum", steps=1),
        "differs from SGD with momentum in one process",
    ),
    # Only the owner needs the average to step, but after step() every rank's gradients are the averages.
    "gradients reduced to their owner only": (
        "zero.py",
        "        for p in self.params:\n            if p.grad is not None:  # a frozen parameter has none, on every rank\n"
        "                dist.all_reduce(p.grad)\n",
        "        for p, owner in zip(self.params, self.owners):\n            if p.grad is not None:\n"
        "                dist.reduce(p.grad, dst=owner)\n",
        lambda folder: check_steps(folder, 2, steps=1),
        "not the average of the ranks' gradients",
    ),
    "every rank broadcasts from itself": (
        "zero.py",
        "                dist.broadcast(p, src=owner)",
        "                dist.broadcast(p, src=dist.get_rank())",
        lambda folder: check_steps(folder, 2, steps=1),
        "with a different src",
    ),
    "the owner does not broadcast": (
        "zero.py",
        "                dist.broadcast(p, src=owner)",
        "                pass",
        lambda folder: check_steps(folder, 2, steps=1),
        "sends the new values to every rank",
    ),
    "every parameter broadcast from rank 0": (
        "zero.py",
        "                dist.broadcast(p, src=owner)",
        "                dist.broadcast(p, src=0)",
        lambda folder: check_steps(folder, 3, steps=1),
        "send each parameter from its owner",
    ),
    "gradients summed, not averaged": (
        "zero.py",
        "                p.grad /= dist.get_world_size()\n",
        "",
        lambda folder: check_steps(folder, 2, steps=1),
        "2.0x the expected average",
    ),
    "gradients not all-reduced": (
        "zero.py",
        "                dist.all_reduce(p.grad)\n                p.grad /= dist.get_world_size()\n",
        "                pass\n",
        lambda folder: check_steps(folder, 2, steps=1),
        "not the average of the ranks' gradients",
    ),
    "the hook all-reduces in float32": (
        "zero.py",
        "    compressed = buffer.to(torch.bfloat16).div_(group.size())",
        "    compressed = buffer.clone().div_(group.size())",
        check_hook,
        "on the wire in bfloat16",
    ),
    "the hook sums": (
        "zero.py",
        "    compressed = buffer.to(torch.bfloat16).div_(group.size())",
        "    compressed = buffer.to(torch.bfloat16)",
        check_hook,
        "2.0x the expected average",
    ),
    "the hook waits for its all-reduce": (
        "zero.py",
        SENT,
        "    dist.all_reduce(compressed, group=group)\n    started = torch.futures.Future()\n"
        "    started.set_result([compressed])\n",
        check_hook,
        "start it with async_op=True",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])


# Issue 47: the exercise done, or helped, by the parts of torch it teaches to write; each passes every check with
# its exercise forbidding nothing (assert_torch_own_caught's control).
TORCH_OWN = {
    "the hook as torch's bf16_compress_hook": (
        "zero.py",
        "    buffer = bucket.buffer()\n",
        "    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n\n"
        "    return default_hooks._compress_hook(torch.bfloat16, group, bucket)\n",
        check_hook,
        "comm_hooks",
    ),
    "torch's ZeroRedundancyOptimizer imported beside the sharded optimizer": (
        "zero.py",
        "        self.params = list(params)\n",
        "        from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401\n\n"
        "        self.params = list(params)\n",
        lambda folder: check_steps(folder, 2, "sgd_momentum"),
        "ZeroRedundancyOptimizer",
    ),
}


@pytest.mark.parametrize("mistake", sorted(TORCH_OWN))
def test_torch_own_is_caught(mistake, tmp_path, monkeypatch):
    assert_torch_own_caught(tmp_path / "mutant", mistake, *TORCH_OWN[mistake], monkeypatch)


def test_a_submission_corrected_after_a_forbidden_import_passes_in_the_same_process(tmp_path):
    """A notebook's kernel keeps its worlds between cells: after a check failed a submission for importing
    ZeroRedundancyOptimizer, whose ranks hold it since, the corrected submission passes (its call gets ranks that
    never imported it)."""
    file, old, new, check, _ = TORCH_OWN["torch's ZeroRedundancyOptimizer imported beside the sharded optimizer"]
    with pytest.raises(AssertionError, match="used torch's ZeroRedundancyOptimizer"):
        check(make_mutant(tmp_path / "mutant", file, old, new))
    check(SOLUTIONS)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--world-size", "0"], "'0' is not a whole number of at least 1"),
        (["--world-size", "5"], "fewer parameters than the 5 ranks"),
        (["--train-size", "100", "--batch-size", "128"], "more than the 90 training rows"),
    ],
)
def test_bad_arguments_are_refused(args, words):
    assert_refused("zero.py", args, words)


def test_the_sharded_optimizer_is_judged_apart_from_assign_owners(tmp_path):
    """ShardedOptimizer calls assign_owners: a wrong rule costs the rule's check, not the optimizer's."""
    folder = make_mutant(tmp_path / "mutant", "zero.py", LEAST_LOADED, "        rank = 0\n")
    with pytest.raises(AssertionError, match="balance the ranks by size"):
        check_owners(folder)
    check_steps(folder, 2, steps=1)
    check_state_bytes(folder, 3)
