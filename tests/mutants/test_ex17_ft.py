"""The checks of exercise 17 catch the classic mistakes of a checkpoint and its restart.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one mistake and shows
that a check fails on it, with a message that points at the mistake.
"""

import pytest

from checks import test_ex17_ft as checks
from tests.mutants import assert_caught

MUTANTS = {
    "a loss that scales with the world size: each rank's own mean": (
        "ft.py",
        '    loss = F.cross_entropy(logits, y, reduction="sum") / batch_size\n',
        "    loss = F.cross_entropy(logits, y)\n",
        lambda folder: checks.test_backward(folder, 2),
        "x the batch's mean's",
    ),
    "gradients not summed over the ranks": (
        "ft.py",
        "    for p in model.parameters():\n        dist.all_reduce(p.grad)\n    return loss.detach()",
        "    return loss.detach()",
        lambda folder: checks.test_backward(folder, 3),
        "is each gradient summed over the ranks?",
    ),
    "shards written where the checkpoint is visible, not aside": (
        "ft.py",
        'aside = os.path.join(folder, f".step{step}.partial")',
        'aside = os.path.join(folder, f"step{step}")',
        checks.test_killed_in_a_save,
        "a save must make it visible only once every rank's shard is written",
    ),
    "newest by the name's order, not the step's": (
        "ft.py",
        'steps = [int(m[1]) for m in (re.fullmatch(r"step(\\d+)", name)',
        'steps = [m[1] for m in (re.fullmatch(r"step(\\d+)", name)',
        checks.test_newest,
        "as names",
    ),
    "Adam's state not restored": (
        "ft.py",
        '    optimizer.adam.state[optimizer.shard] = {"step": shards[0]["step"].clone()}\n'
        '    optimizer.adam.state[optimizer.shard] |= {key: mine(key) for key in ("exp_avg", "exp_avg_sq")}\n',
        "",
        checks.test_round_trip,
        "Adam holds no state for the shard",
    ),
    "Adam's step lost": (
        "ft.py",
        '{"step": shards[0]["step"].clone()}',
        '{"step": torch.tensor(0.0)}',
        checks.test_round_trip,
        "its bias correction",
    ),
    "the model's parameters not loaded, only the shard": (
        "ft.py",
        '    vector_to_parameters(torch.cat([s["param"] for s in shards]), model.parameters())\n',
        "",
        checks.test_round_trip,
        "the model's parameters after load are not those saved",
    ),
    "each rank takes the old shard of its own number": (
        "ft.py",
        '    optimizer.adam.state[optimizer.shard] |= {key: mine(key) for key in ("exp_avg", "exp_avg_sq")}',
        '    optimizer.adam.state[optimizer.shard] |= {key: shards[dist.get_rank()][key] for key in ("exp_avg", "exp_avg_sq")}',
        lambda folder: checks.test_reshard(folder, 4, 2, checks.WIDTHS),
        "is not the one saved for this rank's shard",
    ),
    "load returns the step before the checkpoint's: a batch replayed": (
        "ft.py",
        '    return manifest["step"]',
        '    return manifest["step"] - 1',
        checks.test_round_trip,
        "load returned step 2",
    ),
    "a save torn by a death makes the next save of that step fail": (
        "ft.py",
        "    os.makedirs(aside, exist_ok=True)",
        "    os.makedirs(aside)",
        checks.test_killed_in_a_save,
        "FileExistsError",
    ),
    "the aside folder made by rank 0 alone, failing where a torn save left it": (
        "ft.py",
        "    os.makedirs(aside, exist_ok=True)  # a save torn by a death may have left it\n",
        "    if rank == 0:\n        os.makedirs(aside)\n    dist.barrier()\n",
        checks.test_killed_in_a_save,
        "FileExistsError",
    ),
    "Adam's state loaded without its step": (
        "ft.py",
        '    optimizer.adam.state[optimizer.shard] = {"step": shards[0]["step"].clone()}\n',
        "    optimizer.adam.state[optimizer.shard] = {}\n",
        checks.test_round_trip,
        'has no "step"',
    ),
    "an empty new shard made of no pieces": (
        "ft.py",
        '        return torch.cat([s[key][max(lo, s["lo"]) - s["lo"] : max(0, min(hi, s["hi"]) - s["lo"])] for s in shards])',
        '        return torch.cat([s[key][max(lo, s["lo"]) - s["lo"] : min(hi, s["hi"]) - s["lo"]] for s in shards'
        ' if min(hi, s["hi"]) > max(lo, s["lo"])])',
        lambda folder: checks.test_reshard(folder, 2, 3, checks.TINY),
        "non-empty",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])
