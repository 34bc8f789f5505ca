"""Exercise 7: gradient accumulation, no_sync() and accumulation_step."""

import pytest
import torch
import torch.distributed as dist

from checks.comm_log import CommLog
from checks.contracts import check_contracts
from checks.helpers import (
    CONFIG,
    SMALL_BUCKET_MB,
    SMALL_PARAMETERS,
    SmallMLP,
    drawn_batches,
    global_batch,
    load,
    many,
    world,
)
from course.grading.points import said

BUCKETS = 2  # SMALL's three gradients in buckets of SMALL_BUCKET_MB (checks/helpers.py)
LR = 0.2


def rank_rows(config, step, world_size, micro_batches):
    """This rank's k micro-batches of one step: k * batch_size consecutive rows of the global batch."""
    x, y = global_batch(config, step, world_size * micro_batches)
    rank = dist.get_rank()
    mine = slice(rank * micro_batches * config.batch_size, (rank + 1) * micro_batches * config.batch_size)
    return x[mine], y[mine]


def _start(folder):
    """Every rank starts from the reference's weights (seed 100): OverlappedDP's broadcast has a check
    of its own (exercise 6)."""
    mydp = load(folder).mydp
    torch.manual_seed(100)
    model = mydp.OverlappedDP(SmallMLP(), bucket_cap_mb=SMALL_BUCKET_MB)
    return mydp, model, torch.optim.SGD(model.parameters(), lr=LR)


def by_hand_in_world(folder, micro_batches, mine):
    """Probe, on every rank: a step of micro-batches for each of this rank's rows (``mine``), all but the last
    backward inside no_sync()."""
    _, model, optimizer = _start(folder)
    out = []
    for x, y in mine:
        optimizer.zero_grad()
        inside = 0
        for x_piece, y_piece in list(zip(x.chunk(micro_batches), y.chunk(micro_batches)))[:-1]:
            with model.no_sync(), CommLog() as log:
                (model(x_piece, y_piece)[1] / micro_batches).backward()
            inside += len(log.collectives())
        with CommLog() as log:
            (model(x.chunk(micro_batches)[-1], y.chunk(micro_batches)[-1])[1] / micro_batches).backward()
        grads = {n: p.grad.clone() for n, p in model.module.named_parameters()}
        optimizer.step()
        out.append(
            {"inside": inside, "after": len(log.collectives()), "grads": grads, "params": _params_of(model.module)}
        )
    return out


def accumulation_step_in_world(folder, micro_batches, mine):
    """Probe, on every rank: a call of accumulation_step for each of this rank's rows (``mine``)."""
    mydp, model, optimizer = _start(folder)
    out = []
    for x, y in mine:
        with CommLog() as log:
            loss = float(mydp.accumulation_step(model, optimizer, x, y, micro_batches))
        out.append({"step_collectives": len(log.collectives()), "loss": loss, "params": _params_of(model.module)})
    return out


def reference_steps(world_size, batches):
    """One process on the whole batch of every step: per step, each rank's batch loss, the gradients
    and the parameters after the step."""
    torch.manual_seed(100)  # rank 0's start
    model = SmallMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for x, y in batches:
        rank_losses = [model(xr, yr)[1].item() for xr, yr in zip(x.chunk(world_size), y.chunk(world_size))]
        optimizer.zero_grad()
        model(x, y)[1].backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        out.append({"rank_losses": rank_losses, "grads": grads, "params": _params_of(model)})
    return out


def _params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same_parameters(what, got, expected):
    """Accumulated micro-batches step as one process on the whole batch: each loss divided by their number."""
    for name, p in expected.items():
        assert torch.allclose(got[name], p, rtol=1e-4, atol=1e-5), (
            f"{what}: {name} differs from one process trained on the whole batch: is each micro-batch's"
            " loss divided by the number of micro-batches?"
        )


def check_no_sync_accumulates(folder, world_size=2, micro_batches=3, steps=2):
    """k micro-batches, all but the last inside no_sync(), equal one step on the whole batch."""
    by_hand = {"inside": int, "after": int, "grads": SMALL_PARAMETERS, "params": SMALL_PARAMETERS}
    given = drawn_batches(world_size, steps, micro_batches)
    results = world(by_hand_in_world, world_size, folder, micro_batches, expect=many(by_hand, steps), per_rank=given)
    for step, expected in enumerate(reference_steps(world_size, given.value)):
        for rank, per_step in enumerate(results):
            got = per_step[step]
            what = f"rank {rank}, step {step + 1}, {micro_batches} micro-batches"
            assert got["inside"] == 0, said(
                "collectives started inside no_sync()",
                f"{what}: the backward passes inside no_sync() started {got['inside']} collectives:"
                " inside no_sync() gradients only accumulate, on each rank",
            )
            started = (
                f"{what}: the backward pass after no_sync() started {got['after']} collectives, expected"
                f" one all-reduce per bucket ({BUCKETS})"
            )
            assert got["after"] != 0, said(
                "synchronisation not turned back on after no_sync()",
                f"{started}: leaving no_sync() must turn synchronisation back on",
            )
            assert got["after"] == BUCKETS, said("not one all-reduce per bucket after no_sync()", started)
            for name, grad in expected["grads"].items():
                assert torch.allclose(got["grads"][name], grad, rtol=1e-4, atol=1e-6), (
                    f"{what}: the gradient of {name} after the last backward pass is not the gradient of the"
                    " whole batch's mean loss: does it all-reduce the accumulated .grad"
                    " (register_post_accumulate_grad_hook)?"
                )
            _same_parameters(what, got["params"], expected["params"])


def check_accumulation_step(folder, world_size=2, micro_batches=3, steps=2):
    """accumulation_step: one step on the whole batch, one all-reduce per bucket, the batch's mean loss."""
    stepped = {"step_collectives": int, "loss": float, "params": SMALL_PARAMETERS}
    given = drawn_batches(world_size, steps, micro_batches)
    expect = many(stepped, steps)
    results = world(accumulation_step_in_world, world_size, folder, micro_batches, expect=expect, per_rank=given)
    for step, expected in enumerate(reference_steps(world_size, given.value)):
        for rank, per_step in enumerate(results):
            got = per_step[step]
            what = f"rank {rank}, step {step + 1}, {micro_batches} micro-batches"
            count = got["step_collectives"]
            if count == 0:
                advice = ": the last micro-batch's backward pass must run outside no_sync(), where it all-reduces"
            elif count > BUCKETS:
                advice = ": run the other micro-batches inside model.no_sync()"
            else:
                advice = ""
            assert count == BUCKETS, said(
                "not one all-reduce per bucket, in the last backward pass",
                f"{what}: accumulation_step started {count} collectives, expected {BUCKETS}"
                f" (one per bucket, in the last backward pass){advice}",
            )
            assert abs(got["loss"] - expected["rank_losses"][rank]) < 1e-4, said(
                "a returned loss not the mean over the rank's batch",
                f"{what}: accumulation_step returned {got['loss']:.5f}, the mean loss of the rank's batch is"
                f" {expected['rank_losses'][rank]:.5f}",
            )
            _same_parameters(what, got["params"], expected["params"])


@pytest.mark.points(4)
def test_no_sync_accumulates(impl_dir):
    check_no_sync_accumulates(impl_dir)


@pytest.mark.points(5)
def test_accumulation_step(impl_dir):
    check_accumulation_step(impl_dir)


def nested_no_sync_in_world(folder, micro_batches=3):
    """Probe, on every rank: collectives started by backward passes in nested no_sync() blocks, and by
    the micro-step idiom of training scripts that set require_backward_grad_sync themselves (nanoGPT)."""
    model = load(folder).mydp.OverlappedDP(SmallMLP(), bucket_cap_mb=SMALL_BUCKET_MB)
    x, y = rank_rows(CONFIG, 0, dist.get_world_size(), micro_batches)

    def collectives():
        with CommLog() as log:
            model(x, y)[1].backward()
        return len(log.collectives())

    with model.no_sync():
        with model.no_sync():
            inner = collectives()
        outer = collectives()
    after = collectives()
    try:
        with model.no_sync():
            raise KeyError("raised inside the block")
    except KeyError:
        pass
    after_raise = collectives()
    idiom = []
    for micro_step in range(micro_batches):
        model.require_backward_grad_sync = micro_step == micro_batches - 1
        idiom.append(collectives())
    return {"inner": inner, "outer": outer, "after": after, "after_raise": after_raise, "idiom": idiom}


def check_nested_no_sync(folder, world_size=2, micro_batches=3):
    """A no_sync() block ends with synchronisation as it was before it, as torch's DDP does, even
    when the block raises."""
    for rank, got in enumerate(
        world(
            nested_no_sync_in_world,
            world_size,
            folder,
            micro_batches,
            expect={"inner": int, "outer": int, "after": int, "after_raise": int, "idiom": many(int, micro_batches)},
        )
    ):
        assert got["inner"] == 0, said(
            "collectives inside nested no_sync() blocks",
            f"rank {rank}: a backward pass inside two nested no_sync() blocks started {got['inner']} collectives",
        )
        assert got["outer"] == 0, said(
            "leaving no_sync() turning synchronisation on, not back to its previous value",
            f"rank {rank}: after an inner no_sync() block ended, a backward pass still inside the outer one started"
            f" {got['outer']} collectives: on leaving no_sync(), give the flag back its previous value, not True",
        )
        assert got["after"] == BUCKETS, said(
            "synchronisation not back after nested no_sync() blocks",
            f"rank {rank}: the backward pass after both no_sync() blocks started {got['after']} collectives,"
            f" expected one all-reduce per bucket ({BUCKETS})",
        )
        assert got["after_raise"] == BUCKETS, said(
            "synchronisation not back after a no_sync() block that raised",
            f"rank {rank}: after a no_sync() block that raised, a backward pass started {got['after_raise']}"
            f" collectives, expected {BUCKETS}: synchronisation must come back even when the block raises",
        )
        expected = [0] * (micro_batches - 1) + [BUCKETS]
        assert got["idiom"] == expected, said(
            "no_sync()'s flag not named require_backward_grad_sync",
            f"rank {rank}: with model.require_backward_grad_sync = (micro_step == last), the backward passes started"
            f" {got['idiom']} collectives, expected {expected}: is the flag that no_sync() turns off named"
            " require_backward_grad_sync, as in torch's DDP?",
        )


@pytest.mark.points(5)
def test_nested_no_sync(impl_dir):
    check_nested_no_sync(impl_dir)


@pytest.mark.points(1)
def test_contracts(impl_dir):
    """Every promise declared for the exercise's functions in checks/contracts.py: accumulation_step returns a float, with one micro-batch too."""
    check_contracts(impl_dir, 7)
