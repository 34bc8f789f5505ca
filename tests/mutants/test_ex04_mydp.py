"""The checks of exercise 4 catch the mistakes found in published solutions of MyDP: gradients summed
instead of averaged, the parameter all-reduced instead of its gradient, no start broadcast.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
mistake and shows that the check for it fails, with a message that points at the mistake.
"""

import json

import pytest

from checks.helpers import check_equivalence
from checks.test_ex04_mydp import check_hook_leaves_its_argument, check_mydp_steps, check_start_sync
from tests import warm
from tests.mutants import assert_caught, assert_torch_own_caught, make_mutant

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
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])


# Issue 47: a MyDP that is torch's DDP computes what MyDP must; the kernel's count of its Reducer tells.
TORCH_OWN = (
    "mydp.py",
    "        with torch.no_grad():\n"
    "            for tensor in list(model.parameters()) + list(model.buffers()):\n"
    "                dist.broadcast(tensor, src=0)\n"
    "        for param in model.parameters():\n"
    "            if param.requires_grad:\n"
    "                param.register_hook(self._average_across_ranks)\n",
    "        self.module = nn.parallel.DistributedDataParallel(model)\n",
    lambda folder: check_mydp_steps(folder, 2),
    "DistributedDataParallel",
)


def test_torch_own_ddp_is_caught(tmp_path, monkeypatch):
    assert_torch_own_caught(tmp_path / "mutant", "MyDP as torch's DDP", *TORCH_OWN, monkeypatch)


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
