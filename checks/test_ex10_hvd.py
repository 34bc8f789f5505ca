"""Exercise 10: the Horovod-style API, data parallelism from the optimizer's side."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from checks.comm_log import CommLog
from checks.contracts import check_contracts
from checks.helpers import (
    CONFIG,
    SMALL_PARAMETERS,
    SmallMLP,
    describe_ratio,
    drawn_batches,
    global_batch,
    keyed,
    load,
    many,
    model_with_buffers,
    one_process,
    reference_world,
    world,
)
from course.grading.points import said

OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}
RESUMED_LR = 0.02  # rank 0's checkpoint changed the learning rate: hyper-parameters travel too
OWN_LR = 0.5  # rank 2's own, before the broadcast: what a rank holds already must give way to rank 0's
PRE_STEPS = 2  # steps rank 0 took alone before the checkpoint: its state exists on rank 0 only


def resumed(kind, rank):
    """A model and optimizer as rank `rank` has them before the broadcasts: rank 0 resumed from a
    checkpoint (its weights and optimizer state after PRE_STEPS steps); rank 1 starts fresh, with no
    state at all; rank 2 (in a world of 3) holds state of its own, of one step on data of its own and
    a learning rate of its own, which rank 0's must replace."""
    torch.manual_seed(100 + rank)
    model = SmallMLP()
    optimizer = OPTIMIZERS[kind](model.parameters())
    steps, lr = {0: (PRE_STEPS, RESUMED_LR), 2: (1, OWN_LR)}.get(rank, (0, None))
    for step in range(steps):
        x, y = global_batch(CONFIG, -1 - step - 10 * rank, 1)
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()
    for group in optimizer.param_groups if lr is not None else ():
        group["lr"] = lr
    return model, optimizer


def start_state(folder):
    """Probe: ranks build different weights and buffers, then broadcast_parameters."""
    model = model_with_buffers(dist.get_rank())
    before = list(model.parameters())
    load(folder).hvd.broadcast_parameters(model)
    after = list(model.parameters())
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "same_parameters": len(after) == len(before) and all(a is b for a, b in zip(after, before)),
    }


def check_broadcast_parameters(folder, world_size):
    """broadcast_parameters gives every rank rank 0's parameters and buffers, in the model's own Parameter objects."""
    expected = model_with_buffers(0).state_dict()
    results = world(
        start_state, world_size, folder, expect={"state": keyed(torch.Tensor, expected), "same_parameters": bool}
    )
    for rank, result in enumerate(results):
        assert result["same_parameters"], said(
            "new Parameter objects put in the model",
            f"rank {rank}: broadcast_parameters put new Parameter objects in the model; an optimizer built before"
            " it holds the old ones and would step those: give the model's own parameters rank 0's values",
        )
        state = result["state"]
        for name, value in expected.items():
            what = "buffer" if "running" in name or "num_batches" in name else "parameter"
            assert torch.equal(state[name], value), said(
                f"a {what} not broadcast from rank 0",
                f"after broadcast_parameters, rank {rank}'s {what} {name} is not rank 0's:"
                " every parameter and every buffer comes from rank 0",
            )


def optimizer_state(folder, kind):
    """Probe: rank 0 resumed, the others fresh; each rank's optimizer state after broadcast_optimizer_state."""
    hvd = load(folder).hvd
    model, optimizer = resumed(kind, dist.get_rank())
    wrapped = hvd.DistributedOptimizer(optimizer)
    hvd.broadcast_optimizer_state(wrapped)
    state = optimizer.state_dict()
    return {"state": state["state"], "lr": [group["lr"] for group in state["param_groups"]]}


def check_optimizer_state(folder, world_size, kind="adamw"):
    """broadcast_optimizer_state gives every rank rank 0's optimizer state and hyper-parameters."""
    own = resumed(kind, 0)[1].state_dict()  # rank 0's, as the judge computes it
    expect = {"state": keyed(keyed(object)), "lr": many(float, len(own["param_groups"]))}
    got = world(optimizer_state, world_size, folder, kind, expect=expect)
    expected = got[0]["state"]
    kept = expected.keys() == own["state"].keys() and all(
        values.keys() == expected[index].keys()
        and all(
            torch.allclose(torch.as_tensor(expected[index][k]).double(), torch.as_tensor(v).double())
            for k, v in values.items()
        )
        for index, values in own["state"].items()
    )
    assert kept, said(
        "rank 0's optimizer state lost", "rank 0's resumed optimizer state was lost in broadcast_optimizer_state"
    )
    for rank, mine in enumerate(got):
        for index, values in expected.items():
            assert index in mine["state"], said(
                "no optimizer state on a rank that had none",
                f"after broadcast_optimizer_state, rank {rank} holds no optimizer state for parameter {index}:"
                " rank 0's state must reach every rank, also a rank that has none yet",
            )
            for key, value in values.items():
                assert torch.equal(torch.as_tensor(mine["state"][index][key]), torch.as_tensor(value)), said(
                    "optimizer state not rank 0's",
                    f"after broadcast_optimizer_state, rank {rank}'s {key} of parameter {index} is not rank 0's",
                )
        assert mine["lr"] == [RESUMED_LR] * len(mine["lr"]), said(
            "hyper-parameters not broadcast from rank 0",
            f"after broadcast_optimizer_state, rank {rank}'s learning rate is {mine['lr'][0]}, rank 0's is"
            f" {RESUMED_LR}: the hyper-parameters of rank 0's state (its param_groups) come too",
        )


def parallel_steps(folder, kind, builtin, mine):
    """Probe: steps of DistributedOptimizer (or built-in DDP, with folder None) on this rank's rows of each step
    (``mine``, the only ones it is given). Every rank resumes from rank 0's checkpoint itself, so that the check
    judges the optimizer's averaging, whatever the broadcasts do (their own checks judge them)."""
    model, optimizer = resumed(kind, 0)
    if builtin:  # torch's own DDP averages
        stepper, forward = optimizer, DDP(model)
    else:
        stepper, forward = load(folder).hvd.DistributedOptimizer(optimizer), model
    history, grads, all_reduces = [], None, []
    for step, (x, y) in enumerate(mine):
        stepper.zero_grad()
        forward(x, y)[1].backward()
        with CommLog() as log:
            if not builtin and step == 0:
                stepper.synchronize()  # as before clipping: the step that follows must not average again
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            stepper.step()
        all_reduces.append(log.summary()["collectives"])
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"history": history, "grads": grads, "collectives": all_reduces}


def check_steps(folder, world_size, kind, steps=3):
    """k steps on W ranks equal k steps of one process on the whole batch, and built-in DDP's."""
    history = many(SMALL_PARAMETERS, steps)
    expect = {"history": history, "grads": SMALL_PARAMETERS, "collectives": many(many(str), steps)}
    given = drawn_batches(world_size, steps)
    got = world(parallel_steps, world_size, folder, kind, False, expect=expect, per_rank=given)
    local, expected = one_process(*resumed(kind, 0), given.value, world_size)  # rank 0's checkpoint, whole batches
    for rank, result in enumerate(got):
        for name, grad in result["grads"].items():
            mean = sum(g[name] for g in local) / world_size
            assert torch.allclose(grad, mean, rtol=1e-4, atol=1e-6), describe_ratio(
                name, grad, mean, rank, "after synchronize(), "
            )
        for step, collectives in enumerate(result["collectives"]):
            assert set(collectives) <= {"allreduce"}, said(
                "gradients averaged by other collectives than all-reduce",
                f"rank {rank} started {collectives} in step {step}: the average of the gradients is all-reduces"
                " only, one per dtype",
            )
            assert len(collectives) <= 1, said(
                "an all-reduce per parameter, not one per dtype",
                f"rank {rank} started {len(collectives)} all-reduces in step {step} for gradients of one dtype:"
                " flatten them into one buffer and all-reduce it once, not once per parameter",
            )
        for step in range(steps):
            for name, p in expected[step].items():
                mine = result["history"][step][name]
                assert torch.equal(mine, got[0]["history"][step][name]), said(
                    "ranks' parameters apart after a step",
                    f"after step {step}, rank {rank}'s {name} differs from rank 0's, from the same start: every rank"
                    " must step with the same averaged gradients",
                )
                assert torch.allclose(mine, p, rtol=1e-4, atol=1e-5), (
                    f"after step {step} with {kind}, rank {rank}'s {name} differs from one process that resumed"
                    " from rank 0's checkpoint and trained on the whole batch"
                )
    builtin = reference_world(
        parallel_steps, world_size, None, kind, True, expect={"history": history}, per_rank=given.parts
    )
    builtin = builtin[0]["history"][-1]
    for name, p in builtin.items():
        assert torch.allclose(got[0]["history"][-1][name], p, rtol=1e-4, atol=1e-5), said(
            "steps not built-in DDP's with the same optimizer",
            f"after {steps} steps with {kind}, {name} differs from built-in DDP with the same optimizer",
        )


class TwoDtypes(nn.Module):
    """A float32 weight and bias and a float64 parameter, in the order ``wide_first`` says (a module's own
    parameters come in the order they were set). The float64 gradient carries a third, which float32 cannot
    hold: averaged in float32, it is off by far more than float64's precision."""

    def __init__(self, wide_first):
        super().__init__()
        if wide_first:
            self.wide = nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.weight = nn.Parameter(torch.randn(2, 3))
        self.bias = nn.Parameter(torch.randn(2))
        if not wide_first:
            self.wide = nn.Parameter(torch.ones(2, dtype=torch.float64))

    def forward(self, x):
        return ((x @ self.weight.T + self.bias).double() * self.wide).sum() + self.wide.sum() / 3


def mixed_dtypes(folder):
    """Probe: gradients of two dtypes, float32's first and then float64's first; for each order, each rank's
    gradients before and after synchronize() and the collectives it started."""
    hvd = load(folder).hvd
    rank = dist.get_rank()
    found = []
    for wide_first in (False, True):
        torch.manual_seed(0)
        model = TwoDtypes(wide_first)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.full((4, 3), float(rank + 1))).backward()
        before = {n: p.grad.clone() for n, p in model.named_parameters()}
        with CommLog() as log:
            optimizer.synchronize()
        after = {n: p.grad.clone() for n, p in model.named_parameters()}
        summary = log.summary()
        found.append(
            {
                "before": before,
                "after": after,
                "collectives": summary["collectives"],
                "dtypes": summary["collective_dtypes"],
            }
        )
    return found


def check_mixed_dtypes(folder, world_size=2):
    """Gradients of two dtypes are averaged by one all-reduce per dtype, each in its dtype, in the order the dtypes'
    first gradients come."""
    grads = keyed(torch.Tensor, ["weight", "bias", "wide"])
    one = {"before": grads, "after": grads, "collectives": many(str), "dtypes": many(str)}
    got = world(mixed_dtypes, world_size, folder, expect=many(one, 2))
    for order, first in enumerate(("float32", "float64")):
        results = [r[order] for r in got]
        for rank, result in enumerate(results):
            assert result["collectives"] == ["allreduce", "allreduce"], said(
                "not one all-reduce per dtype",
                f"with float32 and float64 gradients, rank {rank} started {result['collectives']}:"
                " one all-reduce per dtype, each of one flat buffer",
            )
            assert sorted(result["dtypes"]) == ["float32", "float64"], said(
                "a gradient's buffer in another dtype",
                f"for float32 and float64 gradients, rank {rank} all-reduced buffers of {' and '.join(result['dtypes'])}:"
                " each dtype's buffer, and its all-reduce, stays in that dtype (float64 averaged in float32 loses its"
                " precision)",
            )
            expected = [first, "float64" if first == "float32" else "float32"]
            assert result["dtypes"] == expected, said(
                "the dtypes not in the order of their first gradients",
                f"with the {first} gradients first, rank {rank} all-reduced {' then '.join(result['dtypes'])} buffers:"
                f" the dtypes go in the order their first gradients come ({' then '.join(expected)}), so that ranks"
                " started apart (torchrun, spawn) start the same all-reduces in the same order",
            )
            for name, grad in result["after"].items():
                mean = sum(r["before"][name] for r in results) / world_size
                assert grad.dtype == mean.dtype, said(
                    "a gradient's dtype changed",
                    f"synchronize() changed the dtype of {name}'s gradient to {grad.dtype}",
                )
                assert torch.allclose(grad, mean), describe_ratio(
                    name, grad, mean, rank, "with gradients of two dtypes, "
                )
                # A float64 gradient averaged in float32 is off by about 1e-8: float64 is held to its own precision.
                assert grad.dtype != torch.float64 or torch.allclose(grad, mean, rtol=1e-12, atol=0.0), said(
                    "a float64 gradient averaged in another dtype",
                    f"rank {rank}'s float64 gradient {name} is off its mean by {float((grad - mean).abs().max()):.1e}:"
                    " float32's precision, not float64's. Each dtype's buffer, and its all-reduce, stays in that dtype",
                )


@pytest.mark.points(3)
@pytest.mark.parametrize("world_size", [2, 3])
def test_broadcast_parameters(impl_dir, world_size):
    check_broadcast_parameters(impl_dir, world_size)


@pytest.mark.points(3)
@pytest.mark.parametrize("world_size", [2, 3])
def test_broadcast_optimizer_state(impl_dir, world_size):
    check_optimizer_state(impl_dir, world_size)


@pytest.mark.points(5)
@pytest.mark.parametrize("world_size,kind", [(2, "sgd_momentum"), (3, "adamw")])
def test_steps(impl_dir, world_size, kind):
    check_steps(impl_dir, world_size, kind)


@pytest.mark.points(2)
def test_mixed_dtypes(impl_dir):
    check_mixed_dtypes(impl_dir)


@pytest.mark.points(1)
def test_contracts(impl_dir):
    """Every promise declared for the exercise's functions in checks/contracts.py: broadcast_parameters reaches a frozen parameter and a non-persistent buffer, in the model's own tensors."""
    check_contracts(impl_dir, 10)
