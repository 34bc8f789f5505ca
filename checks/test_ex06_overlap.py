"""Exercise 6: OverlappedDP, all-reduces in buckets that run while the backward pass computes."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from checks.comm_log import SUMMARY, CommLog
from checks.contracts import check_contracts
from checks.helpers import (
    alone,
    check_equivalence,
    check_start_sync,
    describe_ratio,
    either,
    keyed,
    load,
    many,
    maybe,
    world,
)
from course.grading.points import said

KIB = 1024


class Deep(nn.Module):
    """Six 32x32 layers: six gradients of 4 KiB, produced last layer first."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32, bias=False) for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Shared(nn.Module):
    """A frozen layer, a layer applied twice, and one weight shared by two layers."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(32, 8, bias=False).requires_grad_(False)
        self.twice = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8, bias=False)
        self.back = nn.Linear(8, 8, bias=False)
        self.back.weight = self.out.weight

    def forward(self, x):
        h = torch.tanh(self.twice(torch.tanh(self.twice(self.frozen(x)))))
        return self.back(torch.tanh(self.out(h)))


class Branches(nn.Module):
    """Two parallel layers whose gradients come in an order that depends on the rank."""

    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(32, 4, bias=False), nn.Linear(32, 4, bias=False)

    def forward(self, x):
        # Autograd runs the branch built last first: rank 0 and rank 1 finish them in opposite orders.
        if dist.is_initialized() and dist.get_rank() % 2:
            return torch.tanh(self.left(x)) + self.right(x)
        right = self.right(x)
        return torch.tanh(self.left(x)) + right


# model, bucket_cap_mb, and the number of buckets that must come out of it:
# Deep: 4 KiB gradients, 8 KiB buckets -> 3.
# Shared: out.weight (256 B), twice.bias (32 B), twice.weight (256 B), last first; 288 B -> 2.
# Branches: one bucket per gradient -> 2.
SETUPS = {
    "Deep": (Deep, 8 * KIB / 2**20, 3),
    "Shared": (Shared, 288 / 2**20, 2),
    "Branches": (Branches, 0, 2),
}


def batch(step, world_size):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4 * world_size, 32, generator=g)


def loss_of(model, x):
    return model(x).pow(2).mean()


def train_logged(folder, setup, steps):
    """Probe, on every rank: train OverlappedDP on its share of each step, logging messages and gradients.

    The test's own post-accumulate hooks, registered before OverlappedDP's, mark in the log the
    moment each gradient is ready, so the log shows what was in flight when.
    """
    mydp = load(folder).mydp
    make, cap, _ = SETUPS[setup]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # every rank starts equal: OverlappedDP's broadcast has its own check
    model = make()
    logs = []
    for i, p in enumerate(p for p in model.parameters() if p.requires_grad):
        p.register_post_accumulate_grad_hook(lambda p, i=i: logs[-1].mark(f"gradient {i}"))
    wrapped = mydp.OverlappedDP(model, bucket_cap_mb=cap)
    made = [b.buffer for b in wrapped.buckets]  # held here, so no later tensor takes their memory
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        x = batch(step, world_size).chunk(world_size)[rank]
        # From the second step on, the .grad tensors stay, zeroed in place: torch's optimizers allow either.
        optimizer.zero_grad(set_to_none=step == 0)
        loss = loss_of(wrapped, x)
        with CommLog() as log:
            logs.append(log)
            try:
                loss.backward()
            except RuntimeError as error:  # on every rank alike, before its bucket's all-reduce starts
                if ALIASED not in str(error):
                    raise  # the failure's own report, with the line of the code under test
                return out + [{"aliased": str(error)[:200]}]
        last = max(i for i, e in enumerate(log.events) if e.kind == "mark")
        left_over = {
            "bucket.ready": [bucket.ready for bucket in wrapped.buckets],
            "self.launched": wrapped.launched,
            "self.finish_queued": wrapped.finish_queued,
        }
        out.append(
            log.summary()
            | {
                "left_over": left_over,
                "started_before_last_gradient": len(log.started(last)),
                "in_flight_at_last_gradient": len(log.in_flight(last)),
                "collective_bytes": sum(e.nbytes for e in log.collectives()),
                "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                # the buckets whose buffer no all-reduce went through
                "buffers_missed": [k for k, b in enumerate(made) if b.data_ptr() not in log.collective_memory()],
            }
        )
        if any(left_over["bucket.ready"]) or left_over["self.launched"] or left_over["self.finish_queued"]:
            return out  # the next pass would fail on counts not reset: every rank stops here alike
        optimizer.step()
        out[-1]["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


# torch's words where a tensor is written from tensors that share its memory (torch.cat(..., out=buffer) from
# .grad tensors that are views of that buffer).
ALIASED = "refer to a single memory location"


def logged(steps):
    """What train_logged returns: a step's figures for each step, up to the first that left counts behind."""
    left_over = {"bucket.ready": many(object), "self.launched": object, "self.finish_queued": object}
    step = SUMMARY | {
        "left_over": left_over,
        "started_before_last_gradient": int,
        "in_flight_at_last_gradient": int,
        "collective_bytes": int,
        "grads": keyed(torch.Tensor),
        "buffers_missed": many(int),
    }
    return many(either(step, {"aliased": str}), range(1, steps + 1))


def assert_reset(rank, step, got):
    """What the end of a backward pass leaves for the next one: .grad tensors of their own, counts at zero, no
    callback queued."""
    assert "aliased" not in got, said(
        "the averages left in the bucket's buffer, not copied into .grad",
        f"rank {rank}, backward pass {step + 1} (after optimizer.zero_grad(set_to_none=False), which keeps the .grad"
        f" tensors) raised: {got.get('aliased')}: the .grad tensors share memory with a bucket's buffer, so"
        " gathering them into it reads what it writes. finish_gradient_synchronization copies the averages into"
        " .grad",
    )
    left = got["left_over"]
    assert not any(left["bucket.ready"]) and not left["self.launched"] and not left["self.finish_queued"], (
        f"rank {rank}, after backward pass {step + 1}: {left} is left for the next pass, expected 0s and False:"
        " reset the counts in finish_gradient_synchronization for the next backward pass"
    )


KIB_PARAMETERS = {
    "small": [256] * 6,
    "mixed": [256, 256, 1024, 256, 256],
}  # elements: 1 KiB each, a 4 KiB one in the middle
BUCKET_CASES = [  # parameters, cap in bytes, expected buckets as indices, what it means
    ("small", 2 * KIB, [[5, 4], [3, 2], [1, 0]], "six 1 KiB gradients in 2 KiB buckets"),
    ("small", 0, [[5], [4], [3], [2], [1], [0]], "a cap of 0 (one bucket per parameter)"),
    ("small", 10**9, [[5, 4, 3, 2, 1, 0]], "a cap larger than the model"),
    ("mixed", 2 * KIB, [[4, 3], [2], [1, 0]], "a 4 KiB gradient among 1 KiB ones, 2 KiB buckets"),
]


def buckets_as_indices(folder):
    """Probe: bucket_parameters on each case, its buckets as parameter indices (None: not a parameter given)."""
    bucket_parameters = load(folder).mydp.bucket_parameters
    out = []
    for kind, cap, _, _ in BUCKET_CASES:
        params = [torch.zeros(n) for n in KIB_PARAMETERS[kind]]
        index = {id(p): i for i, p in enumerate(params)}
        out.append([[index.get(id(p)) for p in bucket] for bucket in bucket_parameters(params, cap)])
    return out


def check_bucket_parameters(folder):
    """bucket_parameters fills buckets last parameter first, a new one when the next would not fit the cap."""
    for (_, _, expected, what), got in zip(
        BUCKET_CASES, alone(buckets_as_indices, folder, expect=many(many(many(maybe(int))), len(BUCKET_CASES)))
    ):
        assert got == expected, (
            f"bucket_parameters with {what} gave buckets {got} (parameter indices), expected {expected}:"
            " walk the parameters last to first, and start a new bucket when the next one would not fit"
        )


def check_overlap(folder):
    """Buckets' all-reduces start during the backward pass and are waited for at its end."""
    steps = world(train_logged, 2, folder, "Deep", 3, expect=logged(3))
    buckets = SETUPS["Deep"][2]
    for rank, per_step in enumerate(steps):
        for step, got in enumerate(per_step):
            what = f"rank {rank}, backward pass {step + 1}, six 4 KiB gradients in 8 KiB buckets"
            assert_reset(rank, step, got)
            assert len(got["collectives"]) == buckets, said(
                "not one all-reduce per bucket",
                f"{what}: started {len(got['collectives'])} collectives, expected one all-reduce per bucket ({buckets})",
            )
            assert got["started_before_last_gradient"] > 0, said(
                "no all-reduce started during the backward pass",
                f"{what}: no all-reduce started before the last gradient was ready: start a bucket's"
                " all-reduce from the hook that completes it, and fill buckets last parameter first",
            )
            assert got["in_flight_at_last_gradient"] > 0, said(
                "all-reduces not asynchronous, none overlapping the backward pass",
                f"{what}: every all-reduce was already finished when the last gradient was ready, so none"
                " overlapped the backward pass: start them with async_op=True and wait only at the end",
            )
            assert not got["not_waited"], said(
                "backward returning before its all-reduces are waited for",
                f"{what}: backward() returned before waiting for {len(got['not_waited'])} all-reduces:"
                " wait for every bucket at the end of the backward pass, before optimizer.step()",
            )
            assert not got["buffers_missed"], said(
                "a bucket's all-reduce not through the buffer made once",
                f"{what}: no all-reduce went through the buffer of bucket {got['buffers_missed'][0]}, the tensor"
                " Bucket made once: a bucket's all-reduce goes through bucket.buffer, in place (a new tensor every"
                " step costs the time to allocate it, many MiB in a real model)",
            )
    check_same_training(folder, "Deep", steps)


def check_same_training(folder, setup, steps, hint=""):
    """The ranks' gradients are averages, and training matches one process on the whole batch."""
    make = SETUPS[setup][0]
    world_size = len(steps)
    torch.manual_seed(0)  # rank 0's start
    model = make()
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(len(steps[0])):
        x = batch(step, world_size)
        local = []
        for piece in x.chunk(world_size):
            model.zero_grad()
            loss_of(model, piece).backward()
            local.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.zero_grad()
        loss_of(model, x).backward()
        optimizer.step()
        for rank, per_step in enumerate(steps):
            got = per_step[step]
            assert_reset(rank, step, got)
            assert got["collective_bytes"] == trainable, said(
                "not each trainable gradient all-reduced once",
                f"backward pass {step + 1} all-reduced {got['collective_bytes']} bytes, the trainable parameters"
                f" hold {trainable}: is a parameter in two buckets, or is its hook registered twice?",
            )
            assert set(got["grads"]) == set(local[0]), said(
                "gradients for other parameters than the trainable ones",
                f"rank {rank} has gradients for {sorted(got['grads'])}, expected {sorted(local[0])}:"
                " a frozen parameter (requires_grad=False) gets no gradient",
            )
            for name, grad in got["grads"].items():
                expected = sum(g[name] for g in local) / world_size
                assert torch.allclose(grad, expected, rtol=1e-4, atol=1e-6), describe_ratio(
                    name, grad, expected, rank, f"backward pass {step + 1}: ", hint
                )
            for name, p in model.named_parameters():
                assert torch.allclose(got["params"][name], p.detach(), rtol=1e-4, atol=1e-5), (
                    f"after step {step + 1}, rank {rank}'s {name} differs from one process trained on the whole batch"
                )


def check_shared_parameters(folder):
    """Frozen, used twice, shared by two layers: each trainable gradient is all-reduced once, when complete."""
    steps = world(train_logged, 2, folder, "Shared", 3, expect=logged(3))
    for rank, per_step in enumerate(steps):
        for step, got in enumerate(per_step):
            assert_reset(rank, step, got)
            assert len(got["collectives"]) == SETUPS["Shared"][2], (
                f"rank {rank}, backward pass {step + 1}: started {len(got['collectives'])} collectives for"
                f" {SETUPS['Shared'][2]} buckets: does a hook fire twice for a parameter used twice?"
            )
    check_same_training(folder, "Shared", steps)


def check_bucket_order(folder):
    """Ranks that finish gradients in different orders still all-reduce the same bucket together."""
    hint = " (the ranks finished their gradients in opposite orders: start the buckets in bucket order on every rank)"
    check_same_training(folder, "Branches", world(train_logged, 2, folder, "Branches", 1, expect=logged(1)), hint)


@pytest.mark.points(3)
def test_bucket_parameters(impl_dir):
    check_bucket_parameters(impl_dir)


@pytest.mark.points(5)
def test_overlap(impl_dir):
    check_overlap(impl_dir)


@pytest.mark.points(4)
def test_shared_parameters(impl_dir):
    check_shared_parameters(impl_dir)


@pytest.mark.points(3)
def test_bucket_order(impl_dir):
    check_bucket_order(impl_dir)


@pytest.mark.points(3)
def test_start_sync(impl_dir):
    check_start_sync(impl_dir, 2, "overlapped")


@pytest.mark.points(3)
@pytest.mark.parametrize("wrap_name, world_size", [("overlapped", 3), ("bucketed", 2)])
def test_overlapped_steps(impl_dir, wrap_name, world_size):
    check_equivalence(impl_dir, wrap_name, world_size)


@pytest.mark.points(1)
def test_contracts(impl_dir):
    """Every promise declared for the exercise's functions in checks/contracts.py: buckets of at most cap_bytes for float64 and bfloat16 gradients, and OverlappedDP's start from rank 0's every parameter and buffer."""
    check_contracts(impl_dir, 6)
