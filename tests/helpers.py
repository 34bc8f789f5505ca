"""Small pieces shared by the exercise checks."""

import torch

from course.launch import run

# Small enough that a multi-rank check takes a fraction of a second; 144 training rows divide
# into batches of 8 and of 16 alike, so one epoch of W ranks matches one epoch of one process.
SMALL = dict(n_layers=3, d_in=12, n_classes=4, d_hidden=10, batch_size=8, train_size=160, niters=12, lr=0.2, seed=3)


def small_config(mlp, **changes):
    return mlp.ModelConfig(**(SMALL | changes))


def world(fn, world_size, *args, ddp=False):
    """Run fn on every rank of a new gloo world; results by rank.

    Collectives are fingerprinted (COURSE_DEBUG) unless the world builds DistributedDataParallel,
    which segfaults on the fingerprinting process group (course/launch.py).
    """
    return run(fn, world_size, *args, debug=False if ddp else None)


def describe_ratio(name, got, expected, rank):
    """A sentence about how a gradient differs from the expected one."""
    ratio = (got * expected).sum() / (expected * expected).sum().clamp_min(1e-30)
    if torch.allclose(got, expected * ratio, rtol=1e-3, atol=1e-6) and abs(ratio - 1) > 1e-3:
        hint = " did you divide by the world size?" if ratio > 1 else ""
        return f"rank {rank}'s gradient of {name} is {ratio:.1f}x the expected average:{hint}"
    return f"rank {rank}'s gradient of {name} is not the average of the ranks' gradients"


def global_batch(config, step, world_size):
    """The rows every rank agrees on for one step: world_size * batch_size of them."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = world_size * config.batch_size
    return torch.randn(rows, config.d_in, generator=g), torch.randint(0, config.n_classes, (rows,), generator=g)


# SMALL's gradients are 160, 400 and 480 bytes, last layer first: buckets of 600 B hold [160, 400], [480].
SMALL_BUCKET_MB = 600 / 2**20


def wrapper(ex, name):
    return {
        "ddp": ex.mlp.wrap_ddp,
        "mydp": lambda model: ex.mydp.MyDP(model),
        "overlapped": lambda model: ex.mydp.OverlappedDP(model, bucket_cap_mb=0),
        "bucketed": lambda model: ex.mydp.OverlappedDP(model, bucket_cap_mb=SMALL_BUCKET_MB),
    }[name]


def parallel_steps(folder, wrap_name, steps):
    """On every rank: ranks start from different weights, wrap, and train on their share of each step."""
    import torch.distributed as dist

    from course import impl

    ex = impl.load(folder)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    config = small_config(ex.mlp)
    torch.manual_seed(100 + rank)  # different on every rank: the wrapper must start them equal
    model = wrapper(ex, wrap_name)(ex.mlp.MLP(config))
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    grads, history = None, []
    for step in range(steps):
        x, y = global_batch(config, step, world_size)
        mine = slice(rank * config.batch_size, (rank + 1) * config.batch_size)
        optimizer.zero_grad()
        _, loss = model(x[mine], y[mine])
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.module.named_parameters()}
        optimizer.step()
        history.append({n: p.detach().clone() for n, p in model.module.named_parameters()})
    return {"grads": grads, "history": history}


def check_equivalence(folder, wrap_name, world_size, steps=3):
    """k parallel steps equal k steps of one process on the concatenated batch, on every rank."""
    from course import impl

    ex = impl.load(folder)
    results = world(parallel_steps, world_size, folder, wrap_name, steps, ddp=wrap_name == "ddp")
    config = small_config(ex.mlp)
    torch.manual_seed(100)  # rank 0's start
    model = ex.mlp.MLP(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    for step in range(steps):
        x, y = global_batch(config, step, world_size)
        if step == 0:
            local = []
            for r in range(world_size):
                model.zero_grad()
                mine = slice(r * config.batch_size, (r + 1) * config.batch_size)
                model(x[mine], y[mine])[1].backward()
                local.append({n: p.grad.clone() for n, p in model.named_parameters()})
            for rank, result in enumerate(results):
                for name, got in result["grads"].items():
                    expected = sum(g[name] for g in local) / world_size
                    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-6), describe_ratio(name, got, expected, rank)
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()
        for rank, result in enumerate(results):
            for name, p in model.named_parameters():
                got = result["history"][step][name]
                assert torch.equal(got, results[0]["history"][step][name]), f"after step {step}, rank {rank}'s {name} differs from rank 0's"
                assert torch.allclose(got, p.detach(), rtol=1e-4, atol=1e-5), (
                    f"after step {step}, rank {rank}'s {name} differs from one process trained on the whole batch"
                    + (": do all ranks start from rank 0's weights?" if step == 0 else "")
                )
