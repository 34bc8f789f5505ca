"""The checks of exercise 9 catch the mistakes of BatchNorm across ranks, parameter averaging and
local SGD, each with a message that points at it; and what the handout says of torch's own
SyncBatchNorm on this CPU build, and of the experiment script, holds.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
mistake and shows that the check for it fails, with a message that points at the mistake.
"""

import json
import os
from contextlib import redirect_stdout
from io import StringIO

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from checks.helpers import CONFIG, load, world
from checks.test_ex09_sync import (
    _start,
    check_average_parameters,
    check_backward,
    check_eval_alone,
    check_forward,
    check_local_sgd,
    check_period_one_is_synchronous,
    check_running_stats,
    check_train_steps,
    local_batches,
    simulate,
)
from course.layout import SOLUTIONS
from tests import warm
from tests.mutants import assert_caught, assert_refused, assert_torch_own_caught, make_mutant

ALL_REDUCE = 'total = funcol.all_reduce(local, "sum", dist.group.WORLD)'
EVAL_BRANCH = (
    "        if not self.training:\n            return self.normalise(x, self.running_mean, self.running_var)\n"
)
UNBIASED = "self.running_var.lerp_(var * count / (count - 1), self.momentum)"
AVERAGE = "            dist.all_reduce(param)\n            param.div_(dist.get_world_size())"
AVERAGE_WHEN = "if step % period == 0 or step == len(batches):"
CALL_THEN_AVERAGE = """            if before_average is not None:
                before_average(step)
            average_parameters(model)"""
AVERAGE_THEN_CALL = """            average_parameters(model)
            if before_average is not None:
                before_average(step)"""


def forward(world_size):
    return lambda folder: check_forward(folder, world_size)


def backward(world_size):
    return lambda folder: check_backward(folder, world_size)


def local_sgd(folder):
    return check_local_sgd(folder, 2, 7, 3)


MUTANTS = {
    # Each rank's BatchNorm on its own rows: what nn.BatchNorm1d does under DDP.
    "local statistics only": (
        "sync.py",
        ALL_REDUCE,
        "total = local",
        forward(2),
        "own rows' mean and variance",
    ),
    # Right forward; autograd treats dist.all_reduce as nothing, so each rank's rows get the
    # gradient of its own loss only.
    "plain dist.all_reduce, no gradient through it": (
        "sync.py",
        ALL_REDUCE,
        "dist.all_reduce(local)\n    total = local",
        backward(2),
        "as if the all-reduce passed no gradient back",
    ),
    "statistics detached": (
        "sync.py",
        ALL_REDUCE,
        'total = funcol.all_reduce(local.detach(), "sum", dist.group.WORLD)',
        backward(3),
        "no gradient reached the mean and variance",
    ),
    # Right while every rank holds rows; a rank without any adds 0 * nan.
    "sums made as mean times count": (
        "sync.py",
        "local = torch.cat([x.new_full((1,), x.shape[0]), x.sum(0), (x * x).sum(0)])",
        "local = torch.cat([x.new_full((1,), x.shape[0]), x.mean(0) * x.shape[0], (x * x).mean(0) * x.shape[0]])",
        forward(3),
        "a mean of no rows is 0 / 0, nan",
    ),
    # Right when every rank holds as many rows; wrong for 5, 8 and 0.
    "count taken as rows x ranks": (
        "sync.py",
        "count, sums, squares = total[0],",
        "count, sums, squares = total[0] * 0 + x.shape[0] * dist.get_world_size(),",
        forward(3),
        "all-reduce the count with the sums",
    ),
    "normalised with the unbiased variance": (
        "sync.py",
        "return count, mean, squares / count - mean * mean",
        "return count, mean, (squares - count * mean * mean) / (count - 1)",
        forward(2),
        "normalise with the biased variance",
    ),
    "biased variance in the running variance": (
        "sync.py",
        UNBIASED,
        "self.running_var.lerp_(var, self.momentum)",
        check_running_stats,
        "running_var takes the unbiased one",
    ),
    "momentum the weight of the old value": (
        "sync.py",
        "self.running_mean.lerp_(mean, self.momentum)",
        "self.running_mean.lerp_(mean, 1 - self.momentum)",
        check_running_stats,
        "momentum is the weight of the new statistic",
    ),
    "running statistics left as they were": (
        "sync.py",
        "        self.running_mean.lerp_(mean, self.momentum)\n        " + UNBIASED + "\n",
        "        pass\n",
        check_running_stats,
        "it did not change",
    ),
    # Right outputs; the running statistics differ from rank to rank, and eval mode then too.
    "running statistics updated from the rank's own rows": (
        "sync.py",
        "self.update_running_stats(count, mean, var)",
        "self.update_running_stats(x.new_tensor(x.shape[0]), x.mean(0), x.var(0, unbiased=False))",
        forward(2),
        "updated from this rank's own rows",
    ),
    "running statistics never updated": (
        "sync.py",
        "self.update_running_stats(count, mean, var)",
        "pass",
        forward(2),
        "it did not change",
    ),
    "eval mode like training mode": (
        "sync.py",
        EVAL_BRANCH,
        "",
        forward(2),
        "in eval mode the running statistics stay as they are",
    ),
    "eval mode normalises with the batch's statistics": (
        "sync.py",
        "return self.normalise(x, self.running_mean, self.running_var)",
        "return self.normalise(x, *global_moments(x)[1:])",
        forward(2),
        "normalised with the batch's statistics",
    ),
    # Right numbers; on one rank alone, the all-reduce waits for ranks that evaluate nothing.
    "eval mode communicates": (
        "sync.py",
        "return self.normalise(x, self.running_mean, self.running_var)",
        "global_moments(x)\n            return self.normalise(x, self.running_mean, self.running_var)",
        check_eval_alone,
        "in eval mode normalise with the running statistics and communicate nothing",
    ),
    "parameters summed, not averaged": (
        "sync.py",
        AVERAGE,
        "            dist.all_reduce(param)",
        lambda folder: check_average_parameters(folder, 3),
        "divide by the world size",
    ),
    "a copy averaged": (
        "sync.py",
        AVERAGE,
        "            param = param.clone()\n" + AVERAGE,
        lambda folder: check_average_parameters(folder, 2),
        "still this rank's own",
    ),
    # The optimizer holds the old Parameter objects: local SGD would step parameters the model no longer has.
    "new Parameter objects put in the model": (
        "sync.py",
        "        for param in model.parameters():\n" + AVERAGE,
        "        for module in model.modules():\n"
        "            for name, param in list(module.named_parameters(recurse=False)):\n"
        "                dist.all_reduce(param)\n"
        "                setattr(module, name, nn.Parameter(param / dist.get_world_size()))",
        lambda folder: check_average_parameters(folder, 2),
        "put new Parameter objects in the model",
    ),
    "no averaging after the last step": (
        "sync.py",
        AVERAGE_WHEN,
        "if step % period == 0:",
        local_sgd,
        "and after the last step",
    ),
    "averaging after every step whatever the period": (
        "sync.py",
        AVERAGE_WHEN,
        "if True:",
        local_sgd,
        "expected [3, 6, 7]",
    ),
    "steps counted from 0": (
        "sync.py",
        "enumerate(batches, start=1)",
        "enumerate(batches)",
        local_sgd,
        "expected [3, 6, 7]",
    ),
    "before_average called after averaging": (
        "sync.py",
        CALL_THEN_AVERAGE,
        AVERAGE_THEN_CALL,
        local_sgd,
        "call it before average_parameters",
    ),
    # Every step after the first adds its gradient to the ones before: the losses part from the third step on.
    "gradients never zeroed in local SGD": (
        "sync.py",
        "        optimizer.zero_grad()\n        _, loss = model(x, y)",
        "        _, loss = model(x, y)",
        local_sgd,
        "gradients were never zeroed",
    ),
    # The right parameters, averaged by a loop of its own instead of average_parameters.
    "local SGD averages without average_parameters": (
        "sync.py",
        "            average_parameters(model)\n    return losses",
        "            with torch.no_grad():\n                for p in model.parameters():\n"
        "                    dist.all_reduce(p)\n                    p /= dist.get_world_size()\n    return losses",
        local_sgd,
        "called average_parameters 0 times",
    ),
    "losses returned as tensors": (
        "sync.py",
        "losses.append(loss.item())",
        "losses.append(loss.detach())",
        local_sgd,
        "as floats",
    ),
    # period=1 must need no before_average.
    "before_average required": (
        "sync.py",
        "            if before_average is not None:\n                before_average(step)",
        "            before_average(step)",
        check_period_one_is_synchronous,
        "'NoneType' object is not callable",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])


def torch_sync_batchnorm(train):
    """Probe: torch.nn.SyncBatchNorm on CPU rows, in training or eval mode; what happened."""
    layer = nn.SyncBatchNorm(3)
    layer.train(train)
    try:
        return ("ran", layer(torch.randn(4, 3) + dist.get_rank()).detach())
    except ValueError as error:
        return ("refused", str(error))


def test_torch_sync_batchnorm_needs_a_gpu_to_synchronise():
    """The handout's claim: on 2 ranks of CPU tensors, torch's SyncBatchNorm refuses to train, and
    its kernels for the statistics exist only for GPUs; in eval mode it runs (nothing to share)."""
    for kind, said in world(torch_sync_batchnorm, 2, True, expect=object):
        assert kind == "refused" and "expected input tensor to be on GPU" in said, said
    with pytest.raises(NotImplementedError, match="CPU"):
        torch.batch_norm_stats(torch.randn(4, 3), 1e-5)
    mean, invstd, counts = torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([4.0, 4.0])
    with pytest.raises(NotImplementedError, match="CPU"):
        torch.batch_norm_gather_stats_with_counts(torch.randn(4, 3), mean, invstd, None, None, 0.1, 1e-5, counts)
    assert all(kind == "ran" for kind, _ in world(torch_sync_batchnorm, 2, False, expect=object))


SMALL_EXPERIMENT = [
    "--train-size",
    "1000",
    "--dim-in",
    "16",
    "--dim-hidden",
    "16",
    "--n-classes",
    "4",
    "--batch-size",
    "16",
]


def test_experiment_script_writes_png_and_json(tmp_path):
    """`python sync.py --non-iid-plot PNG` (small, fast here) writes the plot and its JSON."""
    png = tmp_path / "non_iid.png"
    done = warm.run(["sync.py", *SMALL_EXPERIMENT, "--niters", "16", "--non-iid-plot", str(png)], cwd=SOLUTIONS)
    assert done.returncode == 0, done.stderr
    assert png.stat().st_size > 0
    with open(tmp_path / "non_iid.json") as f:
        found = json.load(f)
    assert set(found["curves"]) == {"IID, sync", "IID, local", "non-IID, sync", "non-IID, local"}
    assert all(curve["step"] == [8, 16] for curve in found["curves"].values())
    assert len(found["curves"]["non-IID, local"]["before"]) == 2 and found["curves"]["IID, sync"]["before"] == []
    assert "final test loss | non-IID, local" in done.stdout
    assert os.path.basename(str(png)) in done.stdout


def own_local_sgd(folder, steps, period):
    """Probe: local_sgd of the folder with its own average_parameters (the checks give it theirs); the parameters."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _start(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=CONFIG.lr)
    load(folder).sync.local_sgd(model, optimizer, local_batches(steps, rank, world_size), period)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_parameters_data_replaced_is_right(tmp_path):
    """`param.data = ...` keeps the Parameter object, which the optimizer holds: it averages as well as an
    in-place division, and local SGD with it trains as local SGD by hand."""
    folder = make_mutant(
        tmp_path / "mutant",
        "sync.py",
        AVERAGE,
        "            dist.all_reduce(param)\n            param.data = param.data / dist.get_world_size()",
    )
    check_average_parameters(folder, 2)
    got = world(own_local_sgd, 2, folder, 7, 3, expect=object)
    _, expected, _, _ = simulate(2, 7, {3, 6, 7})
    for rank, params in enumerate(got):
        assert all(torch.allclose(params[n], p, rtol=1e-4, atol=1e-5) for n, p in expected[rank].items())


def test_forward_is_judged_apart_from_update_running_stats(tmp_path):
    """A wrong update_running_stats costs its own check, not those of forward, which calls it."""
    folder = make_mutant(tmp_path / "mutant", "sync.py", UNBIASED, "self.running_var.lerp_(var, self.momentum)")
    with pytest.raises(AssertionError, match="running_var takes the unbiased one"):
        check_running_stats(folder)
    check_forward(folder, 2)
    check_train_steps(folder, 2)


def test_local_sgd_is_judged_apart_from_average_parameters(tmp_path):
    folder = make_mutant(tmp_path / "mutant", "sync.py", AVERAGE, "            dist.all_reduce(param)")
    with pytest.raises(AssertionError, match="divide by the world size"):
        check_average_parameters(folder, 2)
    local_sgd(folder)
    check_period_one_is_synchronous(folder)


def test_the_documented_differentiable_all_reduce_passes(tmp_path):
    """The handout: the checks accept torch.distributed.nn.functional.all_reduce as well as the functional
    collectives' all_reduce."""
    folder = make_mutant(
        tmp_path / "mutant",
        "sync.py",
        ALL_REDUCE,
        "import torch.distributed.nn.functional as differentiable\n\n    total = differentiable.all_reduce(local)",
    )
    check_forward(folder, 3)
    check_backward(folder, 2)


def demo(rows, features):
    sync = load(SOLUTIONS).sync
    with redirect_stdout(StringIO()):
        return sync.batchnorm_demo(rows, features)


def test_batchnorm_demo_shows_what_the_handout_says():
    """`python sync.py --world-size 2` (8 rows of 256 features per rank): nn.BatchNorm1d's output, running variance and eval-mode output on rank 0
    alone are more than 1 away from one process's; SyncBatchNorm1d's within rounding."""
    found = world(demo, 2, 8, 256, expect=object)[0]
    plain, synced = found["nn.BatchNorm1d"], found["SyncBatchNorm1d"]
    assert plain[0] > 1 and plain[2] > 1 and plain[3] > 1, plain
    assert max(synced) < 1e-5, synced


@pytest.mark.parametrize(
    "args, words",
    [
        (["--world-size", "0"], "'0' is not a whole number of at least 1"),
        (["--world-size", "1", "--rows", "1"], "2 rows at least"),
        (["--rows", "0"], "'0' is not a whole number"),
        (["--period", "0"], "'0' is not a whole number"),
        (["--non-iid-plot", "no/such/folder/x.png"], "no folder no/such/folder"),
        (["--non-iid-plot", "x.png", "--n-classes", "2", "--world-size", "3"], "fewer than the 3 ranks"),
    ],
)
def test_bad_arguments_are_refused(args, words):
    assert_refused("sync.py", args, words)


# Issue 47: the parameters averaged by torch's own model averaging (what PeriodicModelAverager and
# PostLocalSGDOptimizer use): right values, and the modules its ranks load tell (the kernel's count of the system
# calls naming its files where grades are made).
TORCH_OWN = (
    "sync.py",
    "    with torch.no_grad():\n"
    "        for param in model.parameters():\n"
    "            dist.all_reduce(param)\n"
    "            param.div_(dist.get_world_size())\n",
    "    from torch.distributed.algorithms.model_averaging.utils import average_parameters as averaged\n"
    "\n"
    "    averaged(model.parameters(), dist.group.WORLD)\n",
    lambda folder: check_average_parameters(folder, 2),
    "model_averaging",
)


def test_torch_own_model_averaging_is_caught(tmp_path, monkeypatch):
    assert_torch_own_caught(tmp_path / "mutant", "the average as torch's model averaging", *TORCH_OWN, monkeypatch)
