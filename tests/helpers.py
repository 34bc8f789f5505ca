"""Small pieces shared by the exercise checks.

Every check is a probe and a judge. The probe runs in worker processes (course.launch.run): it
loads the implementation under test, runs it, and returns data only (tensors, numbers, strings,
and lists and dicts of those). The judge runs in the grading process, which never imports the
code under test: it compares that data with what it computes itself, from first principles or
with the tests' own model below. So code under test can do what it likes in its workers, and a
verdict is still decided only by code of this repository.
"""

from contextlib import redirect_stdout
from io import StringIO
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course import impl
from course.checks import said
from course.launch import run

# Small enough that a multi-rank check takes a fraction of a second; 144 training rows divide
# into batches of 8 and of 16 alike, so one epoch of W ranks matches one epoch of one process.
SMALL = dict(n_layers=3, d_in=12, n_classes=4, d_hidden=10, batch_size=8, train_size=160, niters=12, lr=0.2, seed=3)
CONFIG = SimpleNamespace(**SMALL)
WIDTHS = [CONFIG.d_in, *[CONFIG.d_hidden] * (CONFIG.n_layers - 1), CONFIG.n_classes]  # of exercise 1's layers


def small_config(mlp, **changes):
    """SMALL as the ModelConfig of the implementation under test (in a worker)."""
    return mlp.ModelConfig(**(SMALL | changes))


def load(folder):
    """The implementation under test; call it only in a probe, never in a judge."""
    return impl.load(folder)


class SmallMLP(nn.Module):
    """The tests' own MLP, the same as exercise 1's: what the wrapper checks train, in the workers
    and in the judge alike, so a data-parallel exercise is judged apart from exercise 1."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(WIDTHS, WIDTHS[1:]))

    def forward(self, data, targets=None):
        logits = forward_from([layer.weight for layer in self.layers], data)
        return logits, (F.cross_entropy(logits, targets) if targets is not None else None)


def forward_from(weights, x):
    """Exercise 1's forward pass from its weight matrices: tanh between the layers, none after the last."""
    for i, weight in enumerate(weights):
        x = x @ weight.T
        if i < len(weights) - 1:
            x = torch.tanh(x)
    return x


def world(fn, world_size, *args, keep=True, debug=True, **options):
    """Run the probe fn on every rank of a gloo world; what it returned, by rank. Collectives are
    checked (debug: each is compared across the ranks before it starts, course/instrument.py), whatever
    COURSE_DEBUG says, unless debug is False (a check of hundreds of collectives whose ranks an earlier
    check compared). The workers are sandboxed (course/sandbox.py): every world that runs submission
    code comes from here or alone(). The world is kept for the next probe of its size and options
    (course/workers.py says what each call gets afresh) unless keep is False; options go to run()
    (timeout, ...)."""
    return run(fn, world_size, *args, keep=keep, sandbox=True, debug=debug, **options)


def _without_process_group(fn, args):
    dist.destroy_process_group()
    try:
        return fn(*args)
    finally:  # the launcher ends every world with a barrier
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def alone(fn, *args):
    """Run the probe fn in one worker process with no process group, as a script run alone
    (mlp.train wraps its model in DDP whenever a process group exists); what it returned."""
    return run(_without_process_group, 1, fn, args, keep=True, sandbox=True)[0]


def printed(fn, *args):
    """fn(*args)'s result and what it printed, in a probe."""
    out = StringIO()
    with redirect_stdout(out):
        result = fn(*args)
    return result, out.getvalue()


def float32_close(got, expected):
    return torch.allclose(got, expected, rtol=1e-3, atol=1e-6)


def describe_ratio(name, got, expected, rank, before="", after="", close=float32_close, whose="gradients"):
    """A sentence about how a gradient differs from the expected one, with its concept (course/checks.py);
    before and after are the check's own words around it (a str added to a Said is a plain str again).
    close(a, b): whether two gradients are equal at the precision they were computed in; whose: the
    concept's subject ("the hook's gradients", say)."""
    ratio = ((got * expected).sum() / (expected * expected).sum().clamp_min(1e-30)).item()
    if close(got, expected * ratio) and not close(expected * ratio, expected):
        hint = " did you divide by the world size?" if ratio > 1 else ""
        concept = f"{whose} summed over the ranks, not averaged" if ratio > 1 else f"{whose} scaled down"
        return said(
            concept, f"{before}rank {rank}'s gradient of {name} is {ratio:.1f}x the expected average:{hint}{after}"
        )
    return said(
        f"{whose} not the average over the ranks",
        f"{before}rank {rank}'s gradient of {name} is not the average of the ranks' gradients{after}",
    )


def global_batch(config, step, world_size):
    """The rows every rank agrees on for one step: world_size * batch_size of them."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = world_size * config.batch_size
    return torch.randn(rows, config.d_in, generator=g), torch.randint(0, config.n_classes, (rows,), generator=g)


# SMALL's gradients are 160, 400 and 480 bytes, last layer first: buckets of 600 B hold [160, 400], [480].
SMALL_BUCKET_MB = 600 / 2**20


def wrapper(ex, name):
    return {
        "ddp": ex.mlp.wrap_ddp,  # exercise 3's
        "torch_ddp": lambda model: torch.nn.parallel.DistributedDataParallel(model),
        "mydp": lambda model: ex.mydp.MyDP(model),
        "overlapped": lambda model: ex.mydp.OverlappedDP(model, bucket_cap_mb=0),
        "bucketed": lambda model: ex.mydp.OverlappedDP(model, bucket_cap_mb=SMALL_BUCKET_MB),
    }[name]


def parallel_steps(folder, wrap_name, steps):
    """Probe, on every rank: wrap the same model, and train on this rank's share of each step.

    Every rank starts from rank 0's weights: the wrapper's broadcast has a check of its own
    (check_start_sync), so that a wrapper that forgets it loses that check, not this one too."""
    ex = load(folder)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100)
    model = SmallMLP()
    wrapped = wrapper(ex, wrap_name)(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=CONFIG.lr)
    grads, history = None, []
    for step in range(steps):
        x, y = global_batch(CONFIG, step, world_size)
        mine = slice(rank * CONFIG.batch_size, (rank + 1) * CONFIG.batch_size)
        optimizer.zero_grad()
        _, loss = wrapped(x[mine], y[mine])
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"grads": grads, "history": history}


def start_state(folder, wrap_name):
    """Probe: ranks build different weights and buffers; the wrapper must hand every rank rank 0's."""
    model = model_with_buffers(dist.get_rank())
    wrapped = wrapper(load(folder), wrap_name)(model)
    return {"kept": wrapped.module is model, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def check_start_sync(folder, world_size, wrap_name="mydp"):
    """After wrapping, every rank holds rank 0's parameters and buffers, in the model it was given."""
    states = world(start_state, world_size, folder, wrap_name)
    expected = model_with_buffers(0).state_dict()
    for rank, got in enumerate(states):
        assert got["kept"] is True, said(
            "the wrapper not keeping the model as .module", "the wrapper should keep the wrapped model as .module"
        )
        for name, value in expected.items():
            assert torch.equal(got["state"][name], value), (
                f"after wrapping the model, rank {rank}'s {name} is not rank 0's: broadcast parameters and buffers from rank 0"
            )


def model_with_buffers(seed):
    """A small model with parameters and buffers. Seeded by rank in a probe, the ranks' copies differ
    (its running_mean holds the seed too); model_with_buffers(0) is rank 0's."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    model[1].running_mean.fill_(float(seed))
    return model


def one_process(model, optimizer, steps, world_size):
    """The judge's run: `steps` steps of one process on each step's whole batch (global_batch). Returns
    each rank's own gradients of the first step's batch, before any step, and the parameters after
    each step."""
    local, history = [], []
    for step in range(steps):
        x, y = global_batch(CONFIG, step, world_size)
        if step == 0:
            for r in range(world_size):
                model.zero_grad()
                mine = slice(r * CONFIG.batch_size, (r + 1) * CONFIG.batch_size)
                model(x[mine], y[mine])[1].backward()
                local.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return local, history


def check_equivalence(folder, wrap_name, world_size, steps=3):
    """k parallel steps equal k steps of one process on the concatenated batch, on every rank."""
    results = world(parallel_steps, world_size, folder, wrap_name, steps)
    torch.manual_seed(100)  # rank 0's start
    model = SmallMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=CONFIG.lr)
    for step in range(steps):
        x, y = global_batch(CONFIG, step, world_size)
        if step == 0:
            local = []
            for r in range(world_size):
                model.zero_grad()
                mine = slice(r * CONFIG.batch_size, (r + 1) * CONFIG.batch_size)
                model(x[mine], y[mine])[1].backward()
                local.append({n: p.grad.clone() for n, p in model.named_parameters()})
            for rank, result in enumerate(results):
                for name, got in result["grads"].items():
                    expected = sum(g[name] for g in local) / world_size
                    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-6), describe_ratio(
                        name, got, expected, rank
                    )
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()
        for rank, result in enumerate(results):
            for name, p in model.named_parameters():
                got = result["history"][step][name]
                assert torch.equal(got, results[0]["history"][step][name]), said(
                    "ranks' parameters apart after a step",
                    f"after step {step}, rank {rank}'s {name} differs from rank 0's",
                )
                assert torch.allclose(got, p.detach(), rtol=1e-4, atol=1e-5), (
                    f"after step {step}, rank {rank}'s {name} differs from one process trained on the whole batch"
                )
