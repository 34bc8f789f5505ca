"""Exercise 11: the optimizer state sharded over the ranks (ZeRO stage 1), and a bfloat16 DDP communication hook."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from checks.comm_log import SUMMARY, CommLog
from checks.contracts import check_contracts
from checks.helpers import (
    CONFIG,
    SMALL_BUCKET_MB,
    SMALL_NAMES,
    SMALL_PARAMETERS,
    SmallMLP,
    describe_ratio,
    drawn_batches,
    keyed,
    load,
    many,
    one_process,
    parameters_of,
    reference_world,
    world,
)
from course.grading.points import said

LR = 0.01  # Adam's
# ShardedOptimizer wraps any torch optimizer: Adam (two tensors of state per parameter) and SGD with momentum (one).
OPTIMIZERS = {
    "adam": ("Adam", torch.optim.Adam, dict(lr=LR)),
    "sgd_momentum": ("SGD with momentum", torch.optim.SGD, dict(lr=CONFIG.lr, momentum=0.9)),
}


class Ragged(nn.Module):
    """Five parameters (120, 10, 100, 10 and 40 elements): a count that neither 2 nor 3 ranks divide."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(CONFIG.d_in, CONFIG.d_hidden)
        self.hidden = nn.Linear(CONFIG.d_hidden, CONFIG.d_hidden)
        self.last = nn.Linear(CONFIG.d_hidden, CONFIG.n_classes, bias=False)

    def forward(self, x, y):
        logits = self.last(torch.tanh(self.hidden(torch.tanh(self.first(x)))))
        return logits, F.cross_entropy(logits, y)


def owners_by_rule(sizes, world_size):
    """The judge's own assignment: largest first (equal sizes in order), each to the least-loaded rank, ties low."""
    owned, result = [0] * world_size, {}
    for size, index in sorted((-n, k) for k, n in enumerate(sizes)):
        least = min(range(world_size), key=lambda r: (owned[r], r))
        result[index] = least
        owned[least] -= size  # size is negative here
    return [result[k] for k in range(len(sizes))]


def loads(sizes, owners, world_size):
    return [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(world_size)]


def state_bytes(state):
    """Bytes of the tensors in an optimizer's state: {parameter: {name: value}}."""
    return sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if torch.is_tensor(t))


# The assignment of parameters to ranks.

OWNER_CASES = [
    ([120, 10, 100, 10, 40], 2),  # Ragged's parameters
    ([120, 10, 100, 10, 40], 3),
    ([5, 5, 5, 5, 5], 3),  # all equal: in order, round the ranks
    ([1, 2, 3, 4, 5, 6, 7, 8], 3),
]


def owners(folder):
    """Probe: assign_owners on every case (rank 0's answer is enough: it is a pure function)."""
    zero = load(folder).zero
    return [list(zero.assign_owners(list(sizes), world_size)) for sizes, world_size in OWNER_CASES]


def check_owners(folder):
    """assign_owners gives each parameter a rank by the rule: largest first, to the least-loaded rank, ties low."""
    got = world(owners, 1, folder, expect=many(many(object), len(OWNER_CASES)))[0]
    for (sizes, world_size), mine in zip(OWNER_CASES, got):
        expected = owners_by_rule(sizes, world_size)
        where = f"assign_owners({sizes}, world_size={world_size}) returned {mine}"
        assert len(mine) == len(sizes), said(
            "not one owner per parameter", f"{where}: one owner per parameter, {len(sizes)} of them"
        )
        assert all(o in range(world_size) for o in mine), said(
            "an owner that is no rank", f"{where}: every owner is a rank in range({world_size})"
        )
        worst, best = max(loads(sizes, mine, world_size)), max(loads(sizes, expected, world_size))
        assert worst <= best, said(
            "owners that do not balance the ranks by size",
            f"{where}: a rank owns {worst} elements where the rule gives at most {best}: balance the ranks"
            " by size, the parameters largest first, each to the rank that owns the fewest elements so far",
        )
        assert mine == expected, said(
            "owners balanced, but not by the rule's order and ties",
            f"{where}, expected {expected}: take the parameters largest first (equal sizes in their order),"
            " each to the rank owning the fewest elements so far, a tie to the lower rank",
        )


def zero_module(folder):
    """zero.py under test, its ShardedOptimizer given the rule's owners (owners_by_rule) instead of its own
    assign_owners: the checks of ShardedOptimizer judge it alone (test_owners judges assign_owners)."""
    zero = load(folder).zero
    zero.assign_owners = owners_by_rule
    return zero


# k steps of the sharded optimizer.


def sharded_steps(folder, optimizer, mine):
    """Probe: the same Ragged on every rank, ShardedOptimizer of one of OPTIMIZERS; each rank steps on its share
    of each batch (``mine``, the only rows it is given)."""
    zero = zero_module(folder)
    torch.manual_seed(0)
    model = Ragged()
    _, kind, defaults = OPTIMIZERS[optimizer]
    optimizer = zero.ShardedOptimizer(model.parameters(), kind, **defaults)
    history, grads = [], None
    for step, (x, y) in enumerate(mine):
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"history": history, "grads": grads, "state_bytes": state_bytes(optimizer.state)}


def stepped(steps):
    """What sharded_steps returns."""
    parameters = parameters_of(Ragged())
    return {"history": many(parameters, steps), "grads": parameters, "state_bytes": int}


def unsharded(batches, world_size, optimizer):
    """The judge's run: one process, the plain optimizer on each whole batch; the ranks' gradients of step 0; its
    history."""
    torch.manual_seed(0)
    model = Ragged()
    _, kind, defaults = OPTIMIZERS[optimizer]
    optimizer = kind(model.parameters(), **defaults)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    local, history = one_process(model, optimizer, batches, world_size)
    return local, [start, *history]


def check_steps(folder, world_size, optimizer="adam", steps=3):
    """k steps of the sharded optimizer (Adam, SGD with momentum) on W ranks equal k steps of it in one process
    on the whole batch."""
    given = drawn_batches(world_size, steps)
    got = world(sharded_steps, world_size, folder, optimizer, expect=stepped(steps), per_rank=given)
    local, expected = unsharded(given.value, world_size, optimizer)
    plain = OPTIMIZERS[optimizer][0]
    names = list(expected[0])
    owner = dict(zip(names, owners_by_rule([expected[0][n].numel() for n in names], world_size)))
    for rank, result in enumerate(got):
        for name, grad in result["grads"].items():
            mean = sum(g[name] for g in local) / world_size
            assert torch.allclose(grad, mean, rtol=1e-4, atol=1e-6), describe_ratio(
                name, grad, mean, rank, "after step(), "
            )
    for step in range(steps):
        for name in names:
            before, after = expected[step][name], expected[step + 1][name]
            for rank, result in enumerate(got):
                mine = result["history"][step][name]
                assert torch.equal(mine, got[0]["history"][step][name]), said(
                    "ranks' parameters apart after a step",
                    f"after step {step}, rank {rank}'s {name} differs from rank 0's: the owner of each parameter"
                    " steps it and sends the new values to every rank",
                )
            mine = got[0]["history"][step][name]
            assert not (torch.equal(mine, before) and not torch.equal(after, before)), said(
                "a parameter not sent from its owner after the step",
                f"after step {step}, {name}, whose owner is rank {owner[name]}, still holds its value from before"
                " the step on every rank: send each parameter from its owner, the rank that stepped it",
            )
            assert torch.allclose(mine, after, rtol=1e-4, atol=1e-6), (
                f"after step {step} on {world_size} ranks, {name} differs from {plain} in one process on the whole batch"
            )


# The memory: each rank's share of the optimizer state.

SIZES = [300, 256, 200, 150, 120, 100, 64, 64, 33, 7, 5]  # elements: parameters of assorted sizes


def one_adam_step(optimizer_of):
    """Parameters of SIZES with gradients, and one step of the optimizer that optimizer_of makes."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n)) for n in SIZES]
    for p in params:
        p.grad = torch.randn(n := p.numel()) / n
    optimizer = optimizer_of(params)
    optimizer.step()
    return optimizer


def sharded_state(folder):
    """Probe: one step of ShardedOptimizer(Adam) on parameters of SIZES; the bytes of this rank's state."""
    zero = zero_module(folder)
    optimizer = one_adam_step(lambda params: zero.ShardedOptimizer(params, torch.optim.Adam, lr=LR))
    return state_bytes(optimizer.state)


def check_state_bytes(folder, world_size):
    """Each rank keeps the optimizer state of the parameters it owns, and of no other."""
    got = world(sharded_state, world_size, folder, expect=int)
    full = one_adam_step(lambda params: torch.optim.Adam(params, lr=LR))
    per_parameter = [state_bytes({0: full.state[p]}) for group in full.param_groups for p in group["params"]]
    owners = owners_by_rule(SIZES, world_size)
    for rank, mine in enumerate(got):
        owned = sum(b for b, owner in zip(per_parameter, owners) if owner == rank)
        assert not (mine == sum(per_parameter) and world_size > 1), said(
            "the whole optimizer state on every rank",
            f"rank {rank} holds {mine} bytes of optimizer state, as much as Adam unsharded: its wrapped optimizer"
            f" must see only the parameters rank {rank} owns",
        )
        assert mine == owned, (
            f"rank {rank} holds {mine} bytes of optimizer state on {world_size} ranks; the parameters it owns"
            f" (self.owners) have {owned} bytes of Adam's state: its wrapped optimizer sees exactly those"
        )


# The same steps as torch's ZeroRedundancyOptimizer.


def zero_redundancy_steps(mine):
    """Probe, no student code: built-in DDP and torch's ZeroRedundancyOptimizer(Adam) on the same model and batches as sharded_steps."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # here: its import scripts optimizers (~1 s)

    torch.manual_seed(0)
    model = Ragged()
    ddp = DDP(model)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    for x, y in mine:
        optimizer.zero_grad()
        ddp(x, y)[1].backward()
        optimizer.step()
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"final": final, "state_bytes": state_bytes(optimizer.optim.state)}


def check_matches_zero_redundancy(folder, world_size, steps=3):
    """ShardedOptimizer, with the rule's owners, keeps the state ZeroRedundancyOptimizer keeps on each rank, and
    trains as DDP with it does."""
    given = drawn_batches(world_size, steps)
    got = world(sharded_steps, world_size, folder, "adam", expect=stepped(steps), per_rank=given)
    theirs = {"final": parameters_of(Ragged()), "state_bytes": int}
    torch_zero = reference_world(zero_redundancy_steps, world_size, expect=theirs, per_rank=given.parts)
    for rank, (mine, theirs) in enumerate(zip(got, torch_zero)):
        assert mine["state_bytes"] == theirs["state_bytes"], said(
            "optimizer state not ZeroRedundancyOptimizer's on a rank",
            f"rank {rank} holds {mine['state_bytes']} bytes of optimizer state, ZeroRedundancyOptimizer"
            f" {theirs['state_bytes']} on the same rank, which owns the same parameters",
        )
        for name, p in theirs["final"].items():
            assert torch.allclose(mine["history"][-1][name], p, rtol=1e-4, atol=1e-6), said(
                "steps not DDP's with ZeroRedundancyOptimizer",
                f"after {steps} steps on {world_size} ranks, rank {rank}'s {name} differs from built-in DDP with"
                " ZeroRedundancyOptimizer(Adam)",
            )


# Part B: the bfloat16 communication hook.

HOOK_STEPS = 4
HOOK_LR = CONFIG.lr  # plain SGD, the lesson's learning rate
# bfloat16 keeps 8 bits of mantissa: each gradient is rounded to a relative error up to 2^-9 on the
# way. Measured here (2 ranks, 4 steps of SGD, lr 0.2, on SmallMLP): the weights differ from float32
# DDP by at most 8.6e-5 (6.0e-5 after the first step). The tolerance leaves ~6x room; a sum instead
# of the average (2x the gradients) misses it by far.
HOOK_ATOL = 5e-4


def torch_hooks():
    """torch's comm hooks, imported in a reference world's ranks only: the exercise forbids them (course/exercises.py),
    and the kernel sees a rank use them only where it opens their files, which no process forked from the grader
    holds."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks


def torch_bf16_hook(group, bucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16_compress_hook under another name: DDP refuses that name on CPU (torch 2.13, it asks
    for NCCL), but the arithmetic runs on gloo as well."""
    return torch_hooks()._compress_hook(torch.bfloat16, group, bucket)


def hooked_steps(folder, hook_name, mine):
    """Probe: built-in DDP on the tests' MLP (two buckets), the named comm hook (the student's loads folder, which
    is None for torch's), a step on each of this rank's rows (``mine``); each step's collectives."""
    torch.manual_seed(0)
    model = SmallMLP()
    ddp = DDP(model, bucket_cap_mb=SMALL_BUCKET_MB)
    hook = {
        "student": lambda: load(folder).zero.bf16_average_hook,
        "torch_bf16": lambda: torch_bf16_hook,
        "torch_fp32": lambda: torch_hooks().allreduce_hook,
        "none": lambda: None,
    }[hook_name]()
    if hook is not None:
        ddp.register_comm_hook(ddp.process_group, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=HOOK_LR)
    history, logs, grads = [], [], []
    for x, y in mine:
        optimizer.zero_grad()
        with CommLog() as log:
            ddp(x, y)[1].backward()
        logs.append(log.summary())
        grads.append({n: (p.grad.clone(), str(p.grad.dtype)) for n, p in model.named_parameters()})
        optimizer.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"history": history, "logs": logs, "grads": grads}


def bf16_close(got, expected):
    """Equal as a whole to bfloat16's precision: two ranks' rounded halves can cancel, so an element
    alone may be far off in relative terms (measured: up to 100% on an element near 0, 0.3% of the norm)."""
    return ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item() <= 2**-6


def check_hook(folder, world_size=2):
    """The hook is used, in bfloat16; it halves the bytes; training stays within HOOK_ATOL of float32 DDP."""
    expect = {
        "history": many(SMALL_PARAMETERS, HOOK_STEPS),
        "logs": many(SUMMARY, HOOK_STEPS),
        "grads": many(keyed((torch.Tensor, str), SMALL_NAMES), HOOK_STEPS),
    }
    given = drawn_batches(world_size, HOOK_STEPS)
    got = world(hooked_steps, world_size, folder, "student", expect=expect, per_rank=given)
    mine = given.parts  # the reference worlds' rows: the same
    fp32 = reference_world(hooked_steps, world_size, None, "torch_fp32", expect=expect, per_rank=mine)
    plain = reference_world(hooked_steps, world_size, None, "none", expect=expect, per_rank=mine)[0]["history"]
    torchs = reference_world(hooked_steps, world_size, None, "torch_bf16", expect=expect, per_rank=mine)[0]["history"]
    buckets = len(fp32[0]["logs"][0]["collectives"])
    for rank, result in enumerate(got):
        for step, log in enumerate(result["logs"]):
            assert log["collectives"], said(
                "the hook not registered, or starting no collective",
                f"in step {step}, rank {rank}'s backward pass started no collective through the hook: register"
                " it with ddp.register_comm_hook and start the all-reduce in it",
            )
            assert set(log["collective_dtypes"]) == {"bfloat16"}, said(
                "buckets not sent in bfloat16",
                f"in step {step}, rank {rank}'s hook all-reduced {log['collective_dtypes']}: every bucket goes on"
                " the wire in bfloat16",
            )
            assert log["collectives"] == ["allreduce"] * buckets, said(
                "not one all-reduce per bucket",
                f"in step {step}, rank {rank}'s hook started {log['collectives']} for {buckets} buckets:"
                " one all-reduce per bucket",
            )
            assert len(log["not_waited"]) == buckets, said(
                "the hook waiting for its all-reduce",
                f"in step {step}, rank {rank}'s hook waited for its all-reduce: start it with async_op=True and"
                " return its future, chained with .then, so that the backward pass goes on while it runs",
            )
            sent, full = sum(log["collective_bytes"]), sum(fp32[rank]["logs"][step]["collective_bytes"])
            assert 2 * sent == full, said(
                "not half the bytes of float32 all-reduces",
                f"rank {rank}'s hook sent {sent} bytes in step {step}, float32 all-reduces {full}",
            )
            for name, (grad, dtype) in result["grads"][step].items():
                assert dtype == "torch.float32", said(
                    "the hook's gradient not float32",
                    f"after the hook, {name}'s gradient is {dtype}: the hook returns the float32 average",
                )
                if step == 0:
                    expected = fp32[rank]["grads"][0][name][0]
                    assert bf16_close(grad, expected), describe_ratio(
                        name, grad, expected, rank, "with the hook, ", close=bf16_close, whose="the hook's gradients"
                    )
        for step in range(HOOK_STEPS):
            for name, p in plain[step].items():
                mine = result["history"][step][name]
                assert torch.equal(mine, got[0]["history"][step][name]), said(
                    "ranks' parameters apart after a step with the hook",
                    f"after step {step}, rank {rank}'s {name} differs from rank 0's: every rank must end with"
                    " the same average from the hook",
                )
                diff = (mine - p).abs().max().item()
                assert diff <= HOOK_ATOL, said(
                    "training further from float32 DDP than bfloat16's rounding explains",
                    f"after step {step}, {name} differs from float32 DDP by {diff:.1e}, more than bfloat16's"
                    f" rounding explains ({HOOK_ATOL:.0e})",
                )
                assert torch.allclose(mine, torchs[step][name], rtol=0, atol=HOOK_ATOL / 4), said(
                    "steps not DDP's with torch's bf16_compress_hook",
                    f"after step {step}, {name} differs from DDP with torch's bf16_compress_hook",
                )


@pytest.mark.points(4)
def test_owners(impl_dir):
    check_owners(impl_dir)


@pytest.mark.points(4)
@pytest.mark.parametrize("world_size, optimizer", [(2, "sgd_momentum"), (3, "adam")])
def test_steps(impl_dir, world_size, optimizer):
    check_steps(impl_dir, world_size, optimizer)


@pytest.mark.points(2)
@pytest.mark.parametrize("world_size", [2, 3])
def test_state_bytes(impl_dir, world_size):
    check_state_bytes(impl_dir, world_size)


@pytest.mark.points(4)
def test_matches_zero_redundancy(impl_dir):
    check_matches_zero_redundancy(impl_dir, 3)


@pytest.mark.points(4)
def test_hook(impl_dir):
    check_hook(impl_dir)


@pytest.mark.points(1)
def test_contracts(impl_dir):
    """Every promise declared for the exercise's functions in checks/contracts.py: the hook's collectives on the group DDP gives it."""
    check_contracts(impl_dir, 11)
