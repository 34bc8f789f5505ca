"""The checks of exercise 10 catch the mistakes of the Horovod-style API.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
mistake and shows that the check for it fails, with a message that points at the mistake.
"""

import pytest

from checks.test_ex10_hvd import check_broadcast_parameters, check_mixed_dtypes, check_optimizer_state, check_steps
from tests.mutants import assert_caught, assert_refused

ONE_BUFFER = """            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat)"""

MUTANTS = {
    "rank 0's optimizer state loaded only where a rank holds none": (
        "hvd.py",
        "    optimizer.load_state_dict(state[0])\n",
        "    if not optimizer.state:\n        optimizer.load_state_dict(state[0])\n",
        lambda folder: check_optimizer_state(folder, 3),
        "after broadcast_optimizer_state, rank 2's",
    ),
    "parameters broadcast, buffers not": (
        "hvd.py",
        "for tensor in [*model.parameters(), *model.buffers()]:",
        "for tensor in model.parameters():",
        lambda folder: check_broadcast_parameters(folder, 2),
        "every parameter and every buffer",
    ),
    # Rank 0's values on every rank, in new Parameter objects: an optimizer built before holds the old ones.
    "new Parameter objects put in the model": (
        "hvd.py",
        "        for tensor in [*model.parameters(), *model.buffers()]:\n            dist.broadcast(tensor, src=0)",
        "        for module in model.modules():\n"
        "            for name, param in list(module.named_parameters(recurse=False)):\n"
        "                fresh = param.detach().clone()\n"
        "                dist.broadcast(fresh, src=0)\n"
        "                setattr(module, name, nn.Parameter(fresh))\n"
        "        for tensor in model.buffers():\n            dist.broadcast(tensor, src=0)",
        lambda folder: check_broadcast_parameters(folder, 2),
        "put new Parameter objects in the model",
    ),
    "optimizer state not broadcast": (
        "hvd.py",
        "    dist.broadcast_object_list(state, src=0)\n    optimizer.load_state_dict(state[0])",
        "    pass",
        lambda folder: check_optimizer_state(folder, 2),
        "also a rank that has none yet",
    ),
    "only the state tensors broadcast, not the hyper-parameters": (
        "hvd.py",
        "    optimizer.load_state_dict(state[0])",
        "    optimizer.load_state_dict(state[0] | {'param_groups': optimizer.state_dict()['param_groups']})",
        lambda folder: check_optimizer_state(folder, 2),
        "the hyper-parameters of rank 0's state",
    ),
    "gradients summed, not averaged": (
        "hvd.py",
        "            flat /= dist.get_world_size()\n",
        "",
        lambda folder: check_steps(folder, 2, "sgd_momentum", steps=1),
        "2.0x the expected average",
    ),
    "one all-reduce per parameter": (
        "hvd.py",
        ONE_BUFFER,
        ONE_BUFFER.replace(
            "            dist.all_reduce(flat)", "            for g in same:\n                dist.all_reduce(g)"
        )
        + "\n            flat = torch.cat([g.reshape(-1) for g in same])",
        lambda folder: check_steps(folder, 2, "sgd_momentum", steps=1),
        "not once per parameter",
    ),
    "the mean never copied back into the gradients": (
        "hvd.py",
        "                grad.copy_(mean.view_as(grad))",
        "                pass",
        lambda folder: check_steps(folder, 2, "adamw", steps=1),
        "not the average of the ranks' gradients",
    ),
    "one buffer for every dtype": (
        "hvd.py",
        "        for dtype in dict.fromkeys(g.dtype for g in grads):\n            same = [g for g in grads if g.dtype == dtype]",
        "        for dtype in [None]:\n            same = grads",
        check_mixed_dtypes,
        "one all-reduce per dtype",
    ),
    "each dtype's buffer made in float32": (
        "hvd.py",
        "flat = torch.cat([g.reshape(-1) for g in same])",
        "flat = torch.cat([g.reshape(-1) for g in same]).float()",
        check_mixed_dtypes,
        "each dtype's buffer, and its all-reduce, stays in that dtype",
    ),
    "the mean copied back through float32": (
        "hvd.py",
        "grad.copy_(mean.view_as(grad))",
        "grad.copy_(mean.float().view_as(grad))",
        check_mixed_dtypes,
        "float32's precision, not float64's",
    ),
    "the dtypes taken in a set's order": (
        "hvd.py",
        "for dtype in dict.fromkeys(g.dtype for g in grads):",
        "for dtype in {g.dtype for g in grads}:",
        check_mixed_dtypes,
        "the dtypes go in the order their first gradients come",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])


@pytest.mark.parametrize(
    "args, words",
    [
        (["--world-size", "0"], "'0' is not a whole number of at least 1"),
        (["--niters", "0"], "'0' is not a whole number"),
        (["--train-size", "100", "--batch-size", "128"], "more than the 90 training rows"),
    ],
)
def test_bad_arguments_are_refused(args, words):
    assert_refused("hvd.py", args, words)
