"""Exercise 9: BatchNorm statistics across ranks, parameter averaging and local SGD.

The judge's BatchNorm is torch.nn.SyncBatchNorm, run here in one process on the rows of every
rank: on this CPU build that is where it runs (on 2 ranks it refuses CPU tensors in training
mode, tests/mutants/test_ex09_sync.py shows it), and there it computes what one process computes
on the whole batch, which is what the student's layer must give on every rank.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from checks.comm_log import CommLog
from checks.contracts import check_contracts
from checks.helpers import (
    CONFIG,
    SMALL_PARAMETERS,
    WIDTHS,
    Given,
    SmallMLP,
    close,
    drawn,
    drawn_batches,
    forward_from,
    global_batch,
    keyed,
    load,
    many,
    maybe,
    tensor,
    world,
)
from course.grading.points import said
from course.launch import WorldFailed

FEATURES = 4
# Rows per rank: uneven on 3 ranks, so a count that is not all-reduced shows.
ROWS = {1: [7], 2: [6, 6], 3: [5, 8, 0]}  # a rank may hold no rows (a last, short batch)
MOMENTUM, EPS = 0.1, 1e-5
TRAIN_STEPS = 2  # training forward passes before the one in eval mode


class Batches:
    """The rows of each step of a check, every rank's, drawn once (drawn()) as the check runs: the judge's,
    and each rank's slice of them, the only rows a rank is given (rows_given())."""

    def __init__(self, rows, steps=TRAIN_STEPS + 1):
        self.rows = rows
        scale = torch.tensor([1.0, 2.0, 0.5, 3.0])
        self.steps = [torch.randn(sum(rows), FEATURES, generator=drawn(900 + s)) * scale + 1.5 for s in range(steps)]

    def all(self, step):
        return self.steps[step]

    def rank(self, step, rank):
        start = sum(self.rows[:rank])
        return self.steps[step][start : start + self.rows[rank]]


def rows_given(rows):
    """What world() gives each rank of the batches of a check on ``rows`` per rank: its own rows of each step."""
    return Given(
        lambda: Batches(rows), lambda b: [([b.rank(s, r) for s in range(len(b.steps))],) for r in range(len(rows))]
    )


def affine():
    g = torch.Generator().manual_seed(7)
    return torch.rand(FEATURES, generator=g) + 0.5, torch.randn(FEATURES, generator=g)


def update_running_stats(layer, count, mean, var):
    """The tests' own update of the running statistics: nn.BatchNorm1d's moving average, the running
    variance towards the unbiased variance."""
    with torch.no_grad():
        layer.num_batches_tracked += 1
        for running, statistic in ((layer.running_mean, mean), (layer.running_var, var * count / (count - 1))):
            running.copy_((1 - MOMENTUM) * running + MOMENTUM * statistic)


def sync_module(folder):
    """sync.py under test, its SyncBatchNorm1d updating the running statistics with the tests' own
    update_running_stats: the checks of forward judge forward alone, whatever update_running_stats does
    (test_running_stats judges that)."""
    sync = load(folder).sync
    sync.SyncBatchNorm1d.update_running_stats = update_running_stats
    return sync


def _layer(folder):
    layer = sync_module(folder).SyncBatchNorm1d(FEATURES)
    weight, bias = affine()
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer


def forward_in_world(folder, mine, steps=TRAIN_STEPS):
    """Probe, on every rank: two training forward passes on this rank's rows of each step (``mine``), then one
    in eval mode."""
    layer = _layer(folder)
    out = {"train": []}
    for step in range(steps):
        y = layer(mine[step])
        out["train"].append(
            {"y": y.detach(), "running_mean": layer.running_mean.clone(), "running_var": layer.running_var.clone()}
        )
    layer.eval()
    out["eval"] = layer(mine[steps]).detach()
    out["after_eval"] = {"running_mean": layer.running_mean.clone(), "running_var": layer.running_var.clone()}
    out["state"] = {k: v.clone() for k, v in layer.state_dict().items()}
    return out


# The judges compare the outputs and running statistics with their own, step by step, and name the mistake of
# the first that differs, before a later step's nan or inf (a negative variance's square root, say).
RUNNING = {"running_mean": tensor(finite=False), "running_var": tensor(finite=False)}
FORWARD = {
    "train": many(RUNNING | {"y": tensor(finite=False)}, TRAIN_STEPS),
    "eval": tensor(finite=False),
    "after_eval": RUNNING,
    "state": keyed(tensor(finite=False)),
}


def torch_layer():
    """The judge's layer: torch's SyncBatchNorm; without a process group, one process on all rows."""
    layer = nn.SyncBatchNorm(FEATURES, eps=EPS, momentum=MOMENTUM)
    weight, bias = affine()
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer


def normalised(x, mean, var):
    weight, bias = affine()
    return (x - mean) / torch.sqrt(var + EPS) * weight + bias


def _output_mistake(sentence, got, x, everything, rows, rank):
    """sentence, about a wrong training output, with the mistake it fits in the student's terms."""
    if close(got, normalised(x, x.mean(0), x.var(0, unbiased=False))):
        return said(
            "each rank normalised with its own rows' statistics",
            f"{sentence}: it normalised with the rank's own rows' mean and variance; all-reduce count, sum and sum"
            " of squares so that every rank uses the statistics of all the rows",
        )
    n = len(everything)
    if close(got, normalised(x, everything.mean(0), everything.var(0, unbiased=True))):
        return said(
            "normalised with the unbiased variance",
            f"{sentence}: it divided the variance by count - 1; normalise with the biased variance (divided by count)",
        )
    rank_count, world_size = rows[rank], len(rows)
    guessed = rank_count * world_size
    if guessed != n:
        mean = everything.sum(0) / guessed
        if close(got, normalised(x, mean, (everything * everything).sum(0) / guessed - mean * mean)):
            return said(
                "the count taken as rows x ranks, not all-reduced",
                f"{sentence}: it took the count to be {rank_count} rows x {world_size} ranks, but the ranks hold"
                f" {n} rows: all-reduce the count with the sums",
            )
    if not torch.isfinite(got).all() and 0 in rows:
        return said(
            "statistics that a rank without rows makes nan",
            f"{sentence}: it holds nan, and rank {rows.index(0)} holds no rows: whatever that rank adds to the"
            " all-reduce must be a number (a mean of no rows is 0 / 0, nan, and the sum carries it to every rank)",
        )
    return said("the training output not BatchNorm's over the rows of all ranks", sentence)


def _running_mistake(sentence, name, got, previous, x):
    """sentence, about running statistics that forward left wrong, with the mistake they fit in the student's terms."""
    if close(got, previous):
        return said(
            "running statistics not updated in training mode",
            f"{sentence}: it did not change; update it in training mode",
        )
    local = x.mean(0) if name == "running_mean" else x.var(0, unbiased=True)
    if close(got, previous.lerp(local, MOMENTUM)):
        return said(
            "running statistics updated from the rank's own rows",
            f"{sentence}: it was updated from this rank's own rows; update it from the all-reduced mean and variance",
        )
    return said("running statistics not one process's on all the rows", sentence)


def moments(x):
    """What global_moments gives update_running_stats for the rows x: (count, mean, biased variance)."""
    return torch.tensor(float(len(x))), x.mean(0), x.var(0, unbiased=False)


def running_stats_in_world(folder, given):
    """Probe: update_running_stats with each of the given moments in turn; the running statistics after each."""
    layer = load(folder).sync.SyncBatchNorm1d(FEATURES)
    out = []
    for count, mean, var in given:
        layer.update_running_stats(count, mean, var)
        out.append({"running_mean": layer.running_mean.clone(), "running_var": layer.running_var.clone()})
    return out


def _update_mistake(sentence, name, got, previous, x):
    """sentence, about running statistics that update_running_stats left wrong, with the mistake they fit."""
    n = len(x)
    statistic = x.mean(0) if name == "running_mean" else x.var(0, unbiased=True)
    if close(got, previous):
        return said("update_running_stats changed nothing", f"{sentence}: it did not change")
    if close(got, previous.lerp(statistic, 1 - MOMENTUM)):
        return said(
            "momentum taken as the weight of the old running value",
            f"{sentence}: momentum is the weight of the new statistic: running = (1 - momentum) * running + momentum"
            " * statistic",
        )
    if name == "running_var" and close(got, previous.lerp(x.var(0, unbiased=False), MOMENTUM)):
        return said(
            "running_var updated with the biased variance",
            f"{sentence}: it was updated with the biased variance; running_var takes the unbiased one,"
            f" var * count / (count - 1), here var * {n} / {n - 1}",
        )
    return said("running statistics not nn.BatchNorm1d's moving average", sentence)


def check_running_stats(folder):
    """update_running_stats moves running_mean towards the mean and running_var towards the unbiased
    variance by momentum, as nn.BatchNorm1d does."""
    batches = Batches([16], TRAIN_STEPS).steps
    (got,) = world(running_stats_in_world, 1, folder, [moments(x) for x in batches], expect=many(RUNNING, TRAIN_STEPS))
    reference = torch_layer()
    for step, (x, found) in enumerate(zip(batches, got)):
        previous = {"running_mean": reference.running_mean.clone(), "running_var": reference.running_var.clone()}
        reference(x)
        for name in ("running_mean", "running_var"):
            sentence = (
                f"after update_running_stats with the moments of {len(x)} rows (call {step + 1}), {name} is not"
                f" nn.BatchNorm1d's after the same rows"
            )
            assert close(found[name], getattr(reference, name)), _update_mistake(
                sentence, name, found[name], previous[name], x
            )


@pytest.mark.points(1)
def test_running_stats(impl_dir):
    check_running_stats(impl_dir)


def check_forward(folder, world_size):
    """Training mode: every rank's output and running statistics are those of one process on all
    the ranks' rows, step after step; eval mode: normalised with the running statistics. The layer
    updates them with the tests' update_running_stats (sync_module)."""
    rows = ROWS[world_size]
    given = rows_given(rows)
    results = world(forward_in_world, world_size, folder, expect=FORWARD, per_rank=given)
    batches = given.value
    reference = torch_layer()
    expected = []
    for step in range(len(results[0]["train"])):
        previous = {"running_mean": reference.running_mean.clone(), "running_var": reference.running_var.clone()}
        y = reference(batches.all(step)).detach()
        expected.append((previous, y, reference.running_mean.clone(), reference.running_var.clone()))
    reference.eval()
    eval_expected = reference(batches.all(len(expected))).detach()
    for rank, got in enumerate(results):
        start = sum(rows[:rank])
        mine = slice(start, start + rows[rank])
        for step, (previous, y, running_mean, running_var) in enumerate(expected):
            what = f"with {world_size} ranks of {rows} rows, step {step + 1}, rank {rank}"
            everything, x = batches.all(step), batches.rank(step, rank)
            output = got["train"][step]["y"]
            assert close(output, y[mine]), _output_mistake(
                f"{what}: the training output is not BatchNorm's over the rows of all ranks",
                output,
                x,
                everything,
                rows,
                rank,
            )
            for name, value in (("running_mean", running_mean), ("running_var", running_var)):
                found = got["train"][step][name]
                assert close(found, value), _running_mistake(
                    f"{what}: {name} is not what one process gets on all the rows", name, found, previous[name], x
                )
        what = f"with {world_size} ranks, rank {rank}, in eval mode"
        for name in ("running_mean", "running_var"):
            assert close(got["after_eval"][name], got["train"][-1][name]), said(
                "running statistics changed in eval mode",
                f"{what}: a forward pass changed {name}; in eval mode the running statistics stay as they are",
            )
        assert close(got["eval"], eval_expected[mine]), (
            said(
                "eval mode normalised with the batch's statistics",
                f"{what}: the output is not the rows normalised with running_mean and running_var: it normalised"
                " with the batch's statistics",
            )
            if _batch_stats_fit(got["eval"], batches, rank)
            else said(
                "eval mode not normalised with the running statistics",
                f"{what}: the output is not the rows normalised with running_mean and running_var",
            )
        )
        try:
            nn.BatchNorm1d(FEATURES).load_state_dict(got["state"])
        except RuntimeError as error:
            raise AssertionError(
                said(
                    "a state_dict that nn.BatchNorm1d cannot load",
                    f"rank {rank}: SyncBatchNorm1d's state_dict does not load into nn.BatchNorm1d: {error}",
                )
            ) from None


def _batch_stats_fit(got, batches, rank):
    everything, x = batches.all(TRAIN_STEPS), batches.rank(TRAIN_STEPS, rank)
    return close(got, normalised(x, everything.mean(0), everything.var(0, unbiased=False))) or close(
        got, normalised(x, x.mean(0), x.var(0, unbiased=False))
    )


def eval_alone_in_world(folder, mine):
    """Probe, on every rank: a training forward pass, then only rank 0 runs one in eval mode, as a script that
    evaluates on rank 0 does; the other ranks return."""
    layer = _layer(folder)
    layer(mine[0])
    if dist.get_rank() != 0:
        return None
    layer.eval()
    return layer(mine[1]).detach()


def check_eval_alone(folder, world_size=2):
    """In eval mode the layer communicates nothing: rank 0 evaluating alone does not wait for the others."""
    try:
        # Rank 0's collective is named by the ranks' comparison (dist's) or the waits boards (a functional one), the
        # rest at the checks' collective timeout (a short one failed a correct layer that a loaded machine slowed).
        (got, *_) = world(
            eval_alone_in_world,
            world_size,
            folder,
            per_rank=rows_given(ROWS[world_size]),
            expect=maybe(torch.Tensor),
            keep=False,
            timeout=30,
        )
    except WorldFailed as failed:
        first = failed.failure.fact(0)
        if failed.failure.kind not in ("mismatch", "wait", "timeout") or first is None:
            raise
        call = first.op or first.collective or "a collective"
        raise AssertionError(
            f"rank 0 alone ran the layer in eval mode, as a script that evaluates on rank 0 does, and it called"
            f" {call} at {first.where()}, which the other ranks, evaluating nothing, never join: in eval mode"
            " normalise with the running statistics and communicate nothing"
        ) from None
    assert got is not None, said("no eval-mode output from rank 0", "rank 0's eval-mode output did not come back")


# On one rank the layer is nn.BatchNorm1d: that case is worth 1 point, the others 2.
@pytest.mark.points(2)
@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.points(1)), 2, 3])
def test_forward(impl_dir, world_size):
    check_forward(impl_dir, world_size)


@pytest.mark.points(2)
def test_eval_alone(impl_dir):
    check_eval_alone(impl_dir)


def coefficients(rows, rank):
    """What rank rank's loss weighs its outputs with: loss = (y * c).sum()."""
    return torch.randn(rows[rank], FEATURES, generator=torch.Generator().manual_seed(50 + rank))


def backward_in_world(folder, rows, mine):
    """Probe, on every rank: the gradients of this rank's loss, (y * c).sum(), after one backward pass on its
    rows of the first step (``mine``)."""
    layer, rank = _layer(folder), dist.get_rank()
    x = mine[0].clone().requires_grad_()
    (layer(x) * coefficients(rows, rank)).sum().backward()
    return {"x": x.grad, "weight": layer.weight.grad, "bias": layer.bias.grad}


def _input_gradient_mistake(sentence, got, batches, rank):
    """sentence, about a wrong input gradient (None: missing), with the mistake it fits in the student's terms."""
    if got is None:
        return said("no gradient for the rank's rows", sentence)
    rows = batches.rows
    parts = [batches.rank(0, r) for r in range(len(rows))]
    x = parts[rank].clone().requires_grad_()
    everything = torch.cat(parts[:rank] + [x] + parts[rank + 1 :])
    mean, var = everything.mean(0), everything.var(0, unbiased=False)
    start = sum(rows[:rank])
    own = normalised(everything, mean, var)[start : start + rows[rank]]
    (own * coefficients(rows, rank)).sum().backward()
    if close(got, x.grad):
        return said(
            "no gradient through the all-reduce",
            f"{sentence}: it is the gradient of this rank's loss alone, as if the all-reduce passed no gradient"
            " back; dist.all_reduce is invisible to autograd, use a differentiable all-reduce"
            " (torch.distributed._functional_collectives.all_reduce or torch.distributed.nn.functional.all_reduce)",
        )
    detached = coefficients(rows, rank) * affine()[0] / torch.sqrt(var.detach() + EPS)
    if close(got, detached):
        return said(
            "the statistics detached from the graph",
            f"{sentence}: no gradient reached the mean and variance; do not detach them, the backward pass needs them",
        )
    return said("the input gradient not one process's", sentence)


def check_backward(folder, world_size):
    """The gradients of the rows of every rank are those of one process on all rows, loss summed."""
    rows = ROWS[world_size]
    given = rows_given(rows)
    expect = dict.fromkeys(("x", "weight", "bias"), maybe(torch.Tensor))
    results = world(backward_in_world, world_size, folder, rows, expect=expect, per_rank=given)
    batches = given.value
    reference = torch_layer()
    everything = batches.all(0).clone().requires_grad_()
    c = torch.cat([coefficients(rows, r) for r in range(world_size)])
    (reference(everything) * c).sum().backward()
    rows_all = everything.detach()
    x_hat = (rows_all - rows_all.mean(0)) / torch.sqrt(rows_all.var(0, unbiased=False) + EPS)
    for rank, got in enumerate(results):
        mine = slice(sum(rows[:rank]), sum(rows[: rank + 1]))
        what = f"with {world_size} ranks of {rows} rows, rank {rank}"
        assert got["x"] is not None and close(got["x"], everything.grad[mine]), _input_gradient_mistake(
            f"{what}: the gradient of the rank's rows is not that of the loss of all ranks together",
            got["x"],
            batches,
            rank,
        )
        for name, share in (("weight", (c[mine] * x_hat[mine]).sum(0)), ("bias", c[mine].sum(0))):
            assert got[name] is not None and close(got[name], share), said(
                "a parameter's gradient not the rank's share of one process's",
                f"{what}: the gradient of {name} is not this rank's share of one process's gradient",
            )


@pytest.mark.points(2)
@pytest.mark.parametrize("world_size", [2, 3])
def test_backward(impl_dir, world_size):
    check_backward(impl_dir, world_size)


class NormMLP(nn.Module):
    """Exercise 1's MLP with a BatchNorm after the first layer: norm is the student's layer in the
    probe, torch's in the judge."""

    def __init__(self, norm):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(WIDTHS, WIDTHS[1:]))
        self.norm = norm

    def forward(self, x, targets=None):
        first, *hidden, last = self.layers
        x = torch.tanh(self.norm(first(x)))
        for layer in hidden:
            x = torch.tanh(layer(x))
        logits = last(x)
        return logits, (F.cross_entropy(logits, targets) if targets is not None else None)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_in_world(folder, mine):
    """Probe, on every rank: a step of data-parallel SGD on each of this rank's rows (``mine``; the test averages
    the gradients), then eval."""
    world_size = dist.get_world_size()
    torch.manual_seed(100)
    model = NormMLP(sync_module(folder).SyncBatchNorm1d(WIDTHS[1]))
    optimizer = torch.optim.SGD(model.parameters(), lr=CONFIG.lr)
    out = {"grads": [], "states": []}
    for x, y in mine:
        optimizer.zero_grad()
        model(x, y)[1].backward()
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        for p in model.parameters():  # the test's own gradient averaging, as DDP's
            dist.all_reduce(p.grad)
            p.grad /= world_size
        optimizer.step()
        out["states"].append(_state(model))
    model.eval()
    out["eval"] = model(global_batch(CONFIG, len(mine), 1)[0])[0].detach()
    return out


def check_train_steps(folder, world_size, steps=3):
    """Steps of a model with the layer on W ranks equal steps of one process on the whole batch:
    the averaged gradients, the parameters and running statistics after each step, eval outputs."""
    state = keyed(torch.Tensor)
    expect = {"grads": many(state, steps), "states": many(state, steps), "eval": torch.Tensor}
    given = drawn_batches(world_size, steps)
    results = world(train_in_world, world_size, folder, expect=expect, per_rank=given)
    torch.manual_seed(100)
    model = NormMLP(nn.SyncBatchNorm(WIDTHS[1], eps=EPS, momentum=MOMENTUM))
    optimizer = torch.optim.SGD(model.parameters(), lr=CONFIG.lr)
    for step, (x, y) in enumerate(given.value):
        optimizer.zero_grad()
        model(x, y)[1].backward()
        for name, p in model.named_parameters():
            averaged = sum(r["grads"][step][name] for r in results) / world_size
            assert torch.allclose(averaged, p.grad, rtol=1e-4, atol=1e-6), said(
                "averaged gradients not one process's on the whole batch",
                f"with {world_size} ranks, step {step + 1}: the ranks' gradients of {name}, averaged, are not"
                " one process's gradient on the whole batch",
            )
        optimizer.step()
        for rank, result in enumerate(results):
            for name, value in _state(model).items():
                got = result["states"][step][name]
                assert got.shape == value.shape and torch.allclose(got.float(), value.float(), rtol=1e-4, atol=1e-5), (
                    said(
                        "parameters or running statistics not one process's after a step",
                        f"with {world_size} ranks, after step {step + 1}, rank {rank}'s {name} is not one process's"
                        " on the whole batch",
                    )
                )
    model.eval()
    expected = model(global_batch(CONFIG, steps, 1)[0])[0].detach()
    for rank, result in enumerate(results):
        assert torch.allclose(result["eval"], expected, rtol=1e-4, atol=1e-5), said(
            "eval-mode outputs not one process's after training",
            f"with {world_size} ranks, rank {rank}: after training, the model's eval-mode outputs are not one process's",
        )


@pytest.mark.points(1)
@pytest.mark.parametrize("world_size", [2, 3])
def test_train_steps(impl_dir, world_size):
    check_train_steps(impl_dir, world_size)


# --- average_parameters and local SGD ---------------------------------------------------------


def _start(rank):
    torch.manual_seed(100 + rank)
    return SmallMLP()


def average_in_world(folder):
    """Probe, on every rank: average_parameters on a model whose weights differ across ranks."""
    net = _start(dist.get_rank())
    before = list(net.parameters())
    load(folder).sync.average_parameters(net)
    after = list(net.parameters())
    return {
        "params": {n: p.detach().clone() for n, p in net.named_parameters()},
        "same_parameters": len(after) == len(before) and all(a is b for a, b in zip(after, before)),
    }


def check_average_parameters(folder, world_size):
    """Every parameter becomes its mean over the ranks, in the model's own Parameter objects."""
    results = world(average_in_world, world_size, folder, expect={"params": SMALL_PARAMETERS, "same_parameters": bool})
    starts = [dict(_start(r).named_parameters()) for r in range(world_size)]
    for rank, got in enumerate(results):
        assert got["same_parameters"], said(
            "new Parameter objects put in the model",
            f"rank {rank}: average_parameters put new Parameter objects in the model; the optimizer holds the old"
            " ones and would step those: give the model's own parameters their new values",
        )
        for name, own in starts[rank].items():
            mean = sum(s[name] for s in starts) / world_size
            found = got["params"][name]
            if torch.allclose(found, mean, rtol=1e-5, atol=1e-6):
                continue
            sentence = (
                f"with {world_size} ranks, rank {rank}'s {name} after average_parameters is not the mean over the ranks"
            )
            if torch.allclose(found, own.detach()):
                raise AssertionError(
                    said(
                        "parameters left as they were",
                        f"{sentence}: it is still this rank's own; average the parameters themselves, in place",
                    )
                )
            assert not torch.allclose(found, mean * world_size, rtol=1e-5, atol=1e-6), said(
                "parameters summed, not averaged",
                f"{sentence}: it is the sum over the ranks, {world_size}x the mean; divide by the world size",
            )
            raise AssertionError(said("parameters not the mean over the ranks", sentence))


@pytest.mark.points(1)
@pytest.mark.parametrize("world_size", [2, 3])
def test_average_parameters(impl_dir, world_size):
    check_average_parameters(impl_dir, world_size)


def local_batches(steps, rank, world_size):
    """This rank's batches: its share of the rows of each step."""
    mine = slice(rank * CONFIG.batch_size, (rank + 1) * CONFIG.batch_size)
    return [tuple(t[mine] for t in global_batch(CONFIG, step, world_size)) for step in range(steps)]


def sync_with_own_averaging(folder, averaged=None):
    """sync.py under test, its local_sgd calling the probes' own average_parameters (the mean by an all-gather,
    one call noted in `averaged` each time): the checks of local_sgd judge local_sgd alone, whatever
    average_parameters does (test_average_parameters judges that)."""
    sync = load(folder).sync

    def average(model):
        if averaged is not None:
            averaged.append(len(list(model.parameters())))
        with torch.no_grad():
            for param in model.parameters():
                every = [torch.empty_like(param) for _ in range(dist.get_world_size())]
                dist.all_gather(every, param)
                param.copy_(torch.stack(every).mean(0))

    sync.average_parameters = average
    return sync


def local_sgd_in_world(folder, steps, period, watch=True):
    """Probe, on every rank: local_sgd from one start; with watch, what before_average saw."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _start(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=CONFIG.lr)
    calls, averaged = [], []

    def note(steps_taken):
        calls.append((int(steps_taken), model.layers[0].weight.detach().clone()))

    sync = sync_with_own_averaging(folder, averaged)
    with CommLog() as log:
        losses = sync.local_sgd(
            model, optimizer, local_batches(steps, rank, world_size), period, note if watch else None
        )
    return {
        "losses": [float(loss) for loss in losses],
        "floats": all(type(loss) is float for loss in losses),
        "calls": [step for step, _ in calls],
        "seen": [weight for _, weight in calls],
        "averaged": len(averaged),
        "own_collectives": len(log.collectives()) - sum(averaged),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


LOCAL_SGD = {
    "losses": many(float),
    "floats": bool,
    "calls": many(int),
    "seen": many(torch.Tensor),
    "averaged": int,
    "own_collectives": int,
    "params": SMALL_PARAMETERS,
}


def simulate(world_size, steps, averages, zero_grad=True):
    """Local SGD by hand: each rank's model steps on its batches; the ranks average after the steps
    in `averages`. Without zero_grad, each backward pass adds to the gradients of the steps before.
    Returns every rank's losses and final parameters, and its first layer's weight just before and
    just after each averaging."""
    models = [_start(0) for _ in range(world_size)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=CONFIG.lr) for m in models]
    batches = [local_batches(steps, r, world_size) for r in range(world_size)]
    losses, seen, averaged = [[] for _ in models], [[] for _ in models], [[] for _ in models]
    for step in range(1, steps + 1):
        for r, (model, optimizer) in enumerate(zip(models, optimizers)):
            if zero_grad:
                optimizer.zero_grad()
            _, loss = model(*batches[r][step - 1])
            loss.backward()
            optimizer.step()
            losses[r].append(loss.item())
        if step in averages:
            for r, model in enumerate(models):
                seen[r].append(model.layers[0].weight.detach().clone())
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in models)):
                    mean = sum(params) / world_size
                    for p in params:
                        p.copy_(mean)
            for r, model in enumerate(models):
                averaged[r].append(model.layers[0].weight.detach().clone())
    return losses, [{n: p.detach() for n, p in m.named_parameters()} for m in models], seen, averaged


def _same(got, expected):
    return all(torch.allclose(got[n], p, rtol=1e-4, atol=1e-5) for n, p in expected.items())


def _same_losses(got, expected):
    return len(got) == len(expected) and all(abs(a - b) < 1e-4 for a, b in zip(got, expected))


def _same_weights(got, expected):
    return len(got) == len(expected) and all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(got, expected))


def check_local_sgd(folder, world_size, steps, period):
    """local_sgd steps on each rank's batches, averages after steps period, 2 * period, ... and the
    last, calls before_average just before each, and returns every step's loss."""
    results = world(local_sgd_in_world, world_size, folder, steps, period, expect=LOCAL_SGD)
    averages = sorted({*range(period, steps + 1, period), steps})
    losses, params, seen, averaged = simulate(world_size, steps, set(averages))
    for rank, got in enumerate(results):
        what = f"with {world_size} ranks, {steps} steps and period={period}, rank {rank}"
        assert got["calls"] == averages, said(
            "before_average called at other steps than the averagings",
            f"{what}: before_average was called after steps {got['calls']}, expected {averages}: just before each"
            " averaging, after steps period, 2 * period, ... and after the last step",
        )
        assert got["floats"], said(
            "losses not returned as floats", f"{what}: local_sgd should return the losses as floats (loss.item())"
        )
        if not _same_losses(got["losses"], losses[rank]):
            sentence = (
                f"{what}: local_sgd returned the losses {[round(x, 4) for x in got['losses']]}, expected each step's"
                f" loss {[round(x, 4) for x in losses[rank]]}"
            )
            accumulated = simulate(world_size, steps, set(averages), zero_grad=False)[0][rank]
            assert not _same_losses(got["losses"], accumulated), said(
                "gradients never zeroed in local SGD",
                f"{sentence}: they are the losses of steps whose gradients were never zeroed, each backward pass"
                " adding to the gradients of the steps before: zero them in every step",
            )
            raise AssertionError(said("local_sgd's losses not each step's", sentence))
        if not _same_weights(got["seen"], seen[rank]):
            sentence = f"{what}: before_average saw other parameters than the rank's own just before averaging"
            assert not _same_weights(got["seen"], averaged[rank]), said(
                "before_average called after averaging",
                f"{sentence}: it saw the averaged parameters; call it before average_parameters, not after",
            )
            raise AssertionError(said("before_average saw other parameters than the rank's own", sentence))
        if not _same(got["params"], params[rank]):
            sentence = f"{what}: the parameters are not those of local SGD averaging after steps {averages}"
            for other, concept, why in (
                (
                    {*range(period, steps + 1, period)},
                    "no averaging after the last step",
                    "average once more after the last step",
                ),
                (
                    {*range(1, steps + 1, period)},
                    "averaging after steps 1, 1 + period, ...",
                    "average after steps period, 2 * period, ..., not 1, 1 + period, ...",
                ),
                (set(range(1, steps + 1)), "averaging every step", "average every period steps, not every step"),
            ):
                assert other == set(averages) or not _same(
                    got["params"], simulate(world_size, steps, other)[1][rank]
                ), said(
                    concept, f"{sentence}: its parameters are those of averaging after steps {sorted(other)}; {why}"
                )
            raise AssertionError(said("local SGD's parameters wrong", sentence))
        assert got["averaged"] == len(averages), said(
            "average_parameters not called once per averaging",
            f"{what}: local_sgd called average_parameters {got['averaged']} times, once at each of the"
            f" {len(averages)} averagings expected",
        )
        assert got["own_collectives"] == 0, said(
            "collectives besides average_parameters's",
            f"{what}: local_sgd started {got['own_collectives']} collectives besides average_parameters's: it"
            " averages with average_parameters only",
        )


@pytest.mark.points(2)
@pytest.mark.parametrize("world_size, steps, period", [(2, 7, 3), (3, 4, 1)])
def test_local_sgd(impl_dir, world_size, steps, period):
    check_local_sgd(impl_dir, world_size, steps, period)


def check_period_one_is_synchronous(folder, world_size=2, steps=3):
    """period=1, no before_average: local_sgd trains as one process on the whole batch of every step."""
    results = world(local_sgd_in_world, world_size, folder, steps, 1, False, expect=LOCAL_SGD)
    model = _start(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=CONFIG.lr)
    for step in range(steps):
        optimizer.zero_grad()
        model(*global_batch(CONFIG, step, world_size))[1].backward()
        optimizer.step()
    for rank, got in enumerate(results):
        assert _same(got["params"], dict(model.named_parameters())), (
            f"with {world_size} ranks, rank {rank}: local_sgd with period=1 did not train as one process on the"
            " whole batch of every step"
        )


@pytest.mark.points(1)
def test_period_one_is_synchronous(impl_dir):
    check_period_one_is_synchronous(impl_dir)


# --- the non-IID claims ------------------------------------------------------------------------

# A small task for SMALL's MLP: 4 overlapping clouds of points, 2 ranks, 3 rounds of local SGD.
# On the reference: label-disjoint / IID test loss 1.00 synchronous, and 1.59 for rank 0's own
# model before averaging (1.52 to 1.59 for other seeds of the data, 0.98 to 1.05 synchronous).
NON_IID = dict(train=400, test=400, batch=32, steps=48, period=16, lr=0.5, scale=0.5, seed=0)
SYNC_MARGIN, DRIFT_RATIO = 0.08, 1.3


def clouds(n, seed_offset):
    g = torch.Generator().manual_seed(NON_IID["seed"])
    centres = torch.randn(WIDTHS[-1], WIDTHS[0], generator=g) * NON_IID["scale"]
    g = torch.Generator().manual_seed(NON_IID["seed"] + seed_offset)
    labels = torch.randint(0, WIDTHS[-1], (n,), generator=g)
    return centres[labels] + torch.randn(n, WIDTHS[0], generator=g), labels


def non_iid_in_world(folder):
    """Probe, on every rank: train with local_sgd on IID or label-disjoint shards, period 1 or
    NON_IID['period']; rank 0's weights at the end and just before each averaging."""
    sync = sync_with_own_averaging(folder)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    X, Y = clouds(NON_IID["train"], 1)
    out = {}
    for non_iid in (False, True):
        rows = (
            torch.nonzero(Y // (WIDTHS[-1] // world_size) == rank).flatten()
            if non_iid
            else torch.arange(rank, len(Y), world_size)
        )
        for period in (1, NON_IID["period"]):
            model = _start(0)
            optimizer = torch.optim.SGD(model.parameters(), lr=NON_IID["lr"])
            g = torch.Generator().manual_seed(10 + rank)
            picks = rows[torch.randint(len(rows), (NON_IID["steps"], NON_IID["batch"]), generator=g)]
            before = []

            def keep(step, model=model, before=before):
                before.append([p.detach().clone() for p in model.parameters()])

            sync.local_sgd(model, optimizer, [(X[p], Y[p]) for p in picks], period, keep)
            out[f"{non_iid}-{period}"] = {
                "final": [p.detach().clone() for p in model.parameters()],
                "before": before if period > 1 else [],
            }
    return out


def held_out_loss(weights):
    X, Y = clouds(NON_IID["test"], 2)
    return F.cross_entropy(forward_from(weights, X), Y).item()


def check_non_iid_claims(folder):
    """What the notebook missed: averaged every step, label-disjoint shards train as well as IID
    ones; averaged every 16 steps, the ranks' own models drift away from a good model."""
    # Hundreds of all-reduces: without the per-call comparison of collectives, which would triple
    # this check's time; test_local_sgd has already compared the ranks' collectives of local_sgd.
    weights = many(torch.Tensor, len(WIDTHS) - 1)
    runs = {
        f"{non_iid}-{period}": {"final": weights, "before": many(weights)}
        for non_iid in (False, True)
        for period in (1, NON_IID["period"])
    }
    result = world(non_iid_in_world, 2, folder, expect=runs, keep=False, debug=False)[0]
    period = NON_IID["period"]
    sync_iid, sync_non = held_out_loss(result["False-1"]["final"]), held_out_loss(result["True-1"]["final"])
    assert abs(sync_non / sync_iid - 1) < SYNC_MARGIN, said(
        "label-disjoint shards training worse than IID ones under synchronous averaging",
        f"averaged after every step, label-disjoint shards ended at test loss {sync_non:.3f} and IID shards at"
        f" {sync_iid:.3f}: synchronous averaging should make them train alike",
    )
    drift = {
        non_iid: sum(held_out_loss(w) for w in result[f"{non_iid}-{period}"]["before"])
        / max(1, len(result[f"{non_iid}-{period}"]["before"]))
        for non_iid in (False, True)
    }
    assert drift[True] > DRIFT_RATIO * drift[False], said(
        "no drift of local SGD's models on label-disjoint shards",
        f"with local SGD (period {period}), rank 0's own model just before averaging had mean test loss"
        f" {drift[True]:.3f} on label-disjoint shards and {drift[False]:.3f} on IID shards: expected the"
        " label-disjoint one to be clearly worse",
    )


@pytest.mark.points(3)
def test_non_iid_claims(impl_dir):
    check_non_iid_claims(impl_dir)


@pytest.mark.points(1)
def test_contracts(impl_dir):
    """Every promise declared for the exercise's functions in checks/contracts.py: the running statistics updated in place."""
    check_contracts(impl_dir, 9)
