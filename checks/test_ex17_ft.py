"""Exercise 17: restart from a sharded checkpoint, on the same world size or another, after a rank's death.

The probes train the checks' own model with the checks' own data-parallel step (each rank its rows, the
whole batch's mean gradient) and the student file's ShardedAdam, and call the student's save, newest and
load. Checkpoints travel from one world to the next only as the files that the judge carries: a world that
loads one never ran the world that saved it, so what it loads is what the files hold. A rank dies by SIGKILL
(course/faults.py), which no code can catch or delay; the judge checks that it died. What a restart must
come to, the judge knows from a run that was never interrupted.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector

from checks.helpers import drawn, forward_from, keyed, load, maybe, tensor, world
from course.faults import Kill, until_a_peer_dies
from course.grading.points import said

WIDTHS = (9, 11, 11, 3)  # 253 parameters: uneven shards on 2, 3 and 4 ranks alike
TINY = (2, 1, 2)  # 4 parameters: on 3 ranks, shards of 2, 2 and none
N = sum(a * b for a, b in zip(WIDTHS, WIDTHS[1:]))
BATCH = 12  # rows: they divide over 1 to 4 ranks
LR = 0.05
STATE = {"params": tensor(), "lo": int, "hi": int, "shard": tensor(), "exp_avg": tensor(), "exp_avg_sq": tensor()}
STATE |= {"step": float, "state": bool}
MISFIT = (
    "the parameters' shard or Adam's state after load is not of the size of the rank's shard, or Adam's state lacks"
)
MISFIT += ' one of "step", "exp_avg" and "exp_avg_sq"'


class Net(nn.Module):
    """The checks' own model: exercise 1's tanh MLP, in float64."""

    def __init__(self, seed, widths=WIDTHS):
        super().__init__()
        torch.manual_seed(seed)
        self.widths = widths
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(widths, widths[1:]))
        self.double()

    def forward(self, x, targets=None):
        logits = forward_from([layer.weight for layer in self.layers], x)
        return logits, (F.cross_entropy(logits, targets) if targets is not None else None)


def batch(seed, step, widths=WIDTHS):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(BATCH, widths[0], generator=g, dtype=torch.float64), torch.randint(
        0, widths[-1], (BATCH,), generator=g
    )


def rows(x):
    """This rank's rows of a batch."""
    size = len(x) // dist.get_world_size()
    return x[dist.get_rank() * size : (dist.get_rank() + 1) * size]


def train_step(model, optimizer, seed, step):
    """The checks' own data-parallel step: the whole batch's mean gradient on every rank, then the optimizer's."""
    x, y = batch(seed, step, model.widths)
    model.zero_grad(set_to_none=True)
    (F.cross_entropy(model(rows(x))[0], rows(y), reduction="sum") / BATCH).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    optimizer.step()


def flat(model):
    return parameters_to_vector(model.parameters()).detach().clone()


def state_of(model, optimizer):
    adam = optimizer.adam.state.get(optimizer.shard, {})
    empty = torch.zeros(0, dtype=torch.float64)
    return {"params": flat(model), "lo": optimizer.lo, "hi": optimizer.hi, "shard": optimizer.shard.detach().clone(),
            "exp_avg": adam.get("exp_avg", empty).clone(), "exp_avg_sq": adam.get("exp_avg_sq", empty).clone(),
            "step": float(adam.get("step", -1.0)), "state": bool(adam)}  # fmt: skip


def fits(optimizer, ok=True):
    """Whether every rank's loaded shard and Adam state have its shard's size (or no state yet), so that the probe
    can train on: agreed over the ranks, so that all of them go on, or none (one that stopped would leave the
    others waiting in the optimizer's all-gather). What load gave is judged first, whatever it was."""
    size = optimizer.hi - optimizer.lo
    adam = optimizer.adam.state.get(optimizer.shard, {})
    ok = (
        ok
        and (not adam or {"step", "exp_avg", "exp_avg_sq"} <= set(adam))
        and optimizer.shard.numel() == size
        and all(adam[key].numel() == size for key in ("exp_avg", "exp_avg_sq") if key in adam)
    )
    misfits = torch.tensor(int(not ok))
    dist.all_reduce(misfits)
    return not misfits


def files_of(folder):
    """Every file under folder, by its path there, as bytes in a tensor (what a world returns is data)."""
    found = {}
    for where, folders, names in os.walk(folder):
        for name in folders:  # an empty one too (a save that a death cut short may leave one): its path and a "/"
            found[os.path.relpath(os.path.join(where, name), folder) + "/"] = torch.zeros(0, dtype=torch.uint8)
        for name in names:
            with open(os.path.join(where, name), "rb") as f:
                found[os.path.relpath(os.path.join(where, name), folder)] = torch.frombuffer(
                    bytearray(f.read()), dtype=torch.uint8
                )
    return found


def unpack(files, folder):
    for path, data in sorted(files.items()):
        os.makedirs(os.path.dirname(os.path.join(folder, path)), exist_ok=True)
        if path.endswith("/"):
            continue
        with open(os.path.join(folder, path), "wb") as f:
            f.write(data.numpy().tobytes())


def shared_folder(token):
    """A folder of the world's (every rank's TMPDIR is the world's own), new for each call."""
    folder = os.path.join(tempfile.gettempdir(), f"checkpoints-{token}")
    os.makedirs(folder, exist_ok=True)
    return folder


def begin(folder, where, seed, widths=WIDTHS, files=None):
    """A probe's start: the student file's ft; the world's checkpoint folder of `where`, with files carried from
    another world unpacked by rank 0 before any rank reads it; the checks' model of seed and its ShardedAdam."""
    ft = load(folder).ft
    checkpoints = shared_folder(where)
    if files is not None:
        if dist.get_rank() == 0:
            unpack(files, checkpoints)
        dist.barrier()
    model = Net(seed, widths)
    return ft, checkpoints, model, ft.ShardedAdam(model, LR)


def seed_from(g, low=0, high=10**6):
    return int(torch.randint(low, high, (1,), generator=g))


def token():
    return os.urandom(6).hex()


def uninterrupted(seed, steps):
    """The run that never stopped, in the judge: one process, the whole batch."""
    model = Net(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = batch(seed, step)
        model.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()
    return flat(model)


# --- backward: the whole batch's mean gradient, whatever the world size ----------------------------------


def backward_in_world(folder, seed):
    ft = load(folder).ft
    model = Net(seed)
    x, y = batch(seed, 0)
    part = ft.backward(model, rows(x), rows(y), BATCH)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    return {"grad": parameters_to_vector(grads).detach(), "part": float(part)}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.points(2)
def test_backward(impl_dir, world_size):
    """backward: every rank's gradients are the whole batch's mean's, and the ranks' losses sum to its mean loss."""
    seed = seed_from(drawn(17))
    got = world(backward_in_world, world_size, impl_dir, seed, expect={"grad": tensor([N]), "part": float})
    model = Net(seed)
    x, y = batch(seed, 0)
    loss = model(x, y)[1]
    loss.backward()
    want = parameters_to_vector(p.grad for p in model.parameters())
    what = f"on {world_size} ranks, each with {BATCH // world_size} of a batch's {BATCH} rows"
    for rank, result in enumerate(got):
        grad = result["grad"]
        if torch.allclose(grad, want, rtol=1e-9, atol=1e-12):
            continue
        ratio = ((grad * want).sum() / (want * want).sum()).item()
        assert not torch.allclose(grad, want * ratio, rtol=1e-9, atol=1e-12), said(
            "a loss that scales with the world size",
            f"{what}: rank {rank}'s gradient is {ratio:.3g}x the batch's mean's: a loss divided by the rows a rank"
            f" holds, or a constant, gives gradients that change with the number of ranks; after a restart on"
            f" another number of ranks training would not go on as it was",
        )
        raise AssertionError(
            said(
                "not the whole batch's mean gradient",
                f"{what}: rank {rank}'s gradient is not the mean cross-entropy's over the whole batch (off by up to"
                f" {(grad - want).abs().max():.3g}): is each gradient summed over the ranks?",
            )
        )
    total = sum(result["part"] for result in got)
    assert abs(total - loss.item()) < 1e-9, said(
        "the ranks' loss parts do not sum to the batch's mean loss",
        f"{what}: the losses backward returned sum to {total:.6f}, where the batch's mean loss is {loss.item():.6f}",
    )


# --- newest: the newest checkpoint by its step -------------------------------------------------------------


def newest_in_world(folder, seed, steps, where):
    ft, checkpoints, model, optimizer = begin(folder, where, seed)
    nothing = ft.newest(checkpoints)
    for step in range(max(steps)):
        train_step(model, optimizer, seed, step)
        if step + 1 in steps:
            ft.save(checkpoints, step + 1, model, optimizer)
    other = Net(seed + 1)
    return {"nothing": nothing is None, "step": ft.load(ft.newest(checkpoints), other, ft.ShardedAdam(other, LR))}


@pytest.mark.points(2)
def test_newest(impl_dir):
    """newest: None in an empty folder; else the checkpoint of the largest step, as a number (12 after 9), on 2 ranks."""
    seed = seed_from(drawn(18))
    got = world(newest_in_world, 2, impl_dir, seed, (3, 9, 12), token(), expect={"nothing": bool, "step": int})[0]
    assert got["nothing"], said(
        "newest finds a checkpoint where there is none", "newest of an empty folder is not None"
    )
    assert got["step"] == 12, said(
        "not the newest checkpoint",
        f"after checkpoints of steps 3, 9 and 12, the one newest() found says step {got['step']}, not 12: are the"
        ' steps compared as numbers? (as names, "step9" comes after "step12")',
    )


# --- a round trip on the same world ------------------------------------------------------------------------


def round_trip_in_world(folder, seed, steps, more, where):
    ft, checkpoints, model, optimizer = begin(folder, where, seed)
    for step in range(steps):
        train_step(model, optimizer, seed, step)
    ft.save(checkpoints, steps, model, optimizer)
    saved = state_of(model, optimizer)
    other = Net(seed + 1)  # other numbers everywhere, and no Adam state yet
    resumed = ft.ShardedAdam(other, LR)
    step = ft.load(ft.newest(checkpoints), other, resumed)
    loaded = state_of(other, resumed)
    if fits(resumed):
        for s in range(step, steps + more):  # each from where it stands
            train_step(other, resumed, seed, s)
    for s in range(steps, steps + more):
        train_step(model, optimizer, seed, s)
    return {"saved": saved, "loaded": loaded, "step": step, "went_on": flat(model), "resumed": flat(other)}


def judge_loaded(loaded, saved, what):
    """The state a rank loaded against the state it should hold (both as state_of() gives them)."""
    for key, name in (("params", "the model's parameters"), ("shard", "the parameters' shard (optimizer.shard)")):
        assert torch.equal(loaded[key], saved[key]), said(
            "the parameters not restored", f"{what}: {name} after load are not those saved"
        )
    assert loaded["state"], said(
        "the optimizer state lost", f"{what}: after load, Adam holds no state for the shard (exp_avg, exp_avg_sq)"
    )
    for key in ("exp_avg", "exp_avg_sq"):
        assert loaded[key].shape == saved[key].shape and torch.equal(loaded[key], saved[key]), said(
            "the optimizer state lost",
            f"{what}: Adam's {key} after load is not the one saved for this rank's shard [{saved['lo']}, {saved['hi']})",
        )
    assert loaded["step"] >= 0, said(
        "Adam's step lost",
        f'{what}: after load, Adam\'s state for the shard has no "step" (the count its bias correction needs)',
    )
    assert loaded["step"] == saved["step"], said(
        "Adam's step lost",
        f"{what}: Adam's step after load is {loaded['step']:g}, not {saved['step']:g}: its bias correction"
        " depends on it, and the next updates would be larger than the uninterrupted run's",
    )


@pytest.mark.points(4)
def test_round_trip(impl_dir):
    """save then load on the same 2 ranks: every rank's state as saved, load's step, and the next steps as if no stop."""
    seed = seed_from(drawn(19))
    expect = {"saved": STATE, "loaded": STATE, "step": int, "went_on": tensor([N]), "resumed": tensor([N])}
    got = world(round_trip_in_world, 2, impl_dir, seed, 3, 2, token(), expect=expect)
    for rank, result in enumerate(got):
        assert result["step"] == 3, said(
            "batches skipped or replayed",
            f"load returned step {result['step']} for a checkpoint saved after 3 steps: training would go on from"
            " another batch than the one it stopped before",
        )
        judge_loaded(
            result["loaded"], result["saved"], f"saved after 3 steps on 2 ranks, loaded on the same: rank {rank}"
        )
        assert torch.equal(result["resumed"], result["went_on"]), said(
            "the next steps not those of a run that never stopped",
            f"rank {rank}: 2 steps after the load, the parameters are not those of the run that went on without"
            f" stopping (off by up to {(result['resumed'] - result['went_on']).abs().max():.3g})",
        )


# --- resharding: saved on W ranks, loaded on W' ------------------------------------------------------------


def save_in_world(folder, seed, steps, more, where, widths):
    ft, checkpoints, model, optimizer = begin(folder, where, seed, widths)
    for step in range(steps):
        train_step(model, optimizer, seed, step)
    ft.save(checkpoints, steps, model, optimizer)
    saved = state_of(model, optimizer)
    for step in range(steps, steps + more):
        train_step(model, optimizer, seed, step)
    dist.barrier()
    return {"saved": saved, "files": files_of(checkpoints) if dist.get_rank() == 0 else {}, "went_on": flat(model)}


def load_in_world(folder, seed, steps, more, where, files, widths):
    ft, checkpoints, model, optimizer = begin(folder, where, seed + 1, widths, files)
    step = ft.load(ft.newest(checkpoints), model, optimizer)
    loaded = state_of(model, optimizer)
    if fits(optimizer):
        for s in range(step, steps + more):
            train_step(model, optimizer, seed, s)
    return {"loaded": loaded, "step": step, "went_on": flat(model)}


def whole(saved, key):
    """A flat vector of the world's, from each rank's shard of it."""
    return torch.cat([part[key] for part in sorted(saved, key=lambda part: part["lo"])])


@pytest.mark.parametrize(
    "saved_on, loaded_on, widths",
    [(4, 2, WIDTHS), (2, 3, WIDTHS), (4, 3, WIDTHS), (2, 3, TINY)],
    ids=["4-2", "2-3", "4-3", "2-3-tiny"],
)
@pytest.mark.points(2)
def test_reshard(impl_dir, saved_on, loaded_on, widths):
    """load on another world size: each rank's new shard of the parameters and of Adam's state, taken from the old
    shards; one shard of the TINY model's 4 parameters on 3 ranks is empty."""
    seed = seed_from(drawn(20 + saved_on * 10 + loaded_on + len(widths)))
    n = sum(a * b for a, b in zip(widths, widths[1:]))
    where = token()
    expect = {"saved": STATE, "files": keyed(tensor(dtype=torch.uint8)), "went_on": tensor([n])}
    before = world(save_in_world, saved_on, impl_dir, seed, 3, 2, where, widths, expect=expect)
    got = world(load_in_world, loaded_on, impl_dir, seed, 3, 2, token(), before[0]["files"], widths,
                expect={"loaded": STATE, "step": int, "went_on": tensor([n])})  # fmt: skip
    saved = [result["saved"] for result in before]
    everything = {key: whole(saved, key) for key in ("shard", "exp_avg", "exp_avg_sq")}
    for rank, result in enumerate(got):
        loaded = result["loaded"]
        lo, hi = loaded["lo"], loaded["hi"]
        what = (
            f"{n} parameters saved on {saved_on} ranks, loaded on {loaded_on}: rank {rank}, whose shard is [{lo}, {hi})"
        )
        assert result["step"] == 3, said(
            "batches skipped or replayed", f"{what}: load returned step {result['step']} for a checkpoint of step 3"
        )
        should = {"params": saved[0]["params"], "step": saved[0]["step"]}
        should |= {key: everything[key][lo:hi] for key in everything} | {"lo": lo, "hi": hi}
        judge_loaded(loaded, should, what)
        apart = (result["went_on"] - before[0]["went_on"]).abs().max().item()
        assert apart < 1e-9, said(
            "training after a reshard not the uninterrupted run's",
            f"{what}: 2 steps after the load the parameters are {apart:.3g} from those of the run that went on"
            f" on {saved_on} ranks",
        )


# --- a rank dies: the restart goes on from the newest whole checkpoint ---------------------------------------


def killed_in_world(folder, seed, steps, every, kill, where):
    ft, checkpoints, model, optimizer = begin(folder, where, seed)
    with until_a_peer_dies() as lost:
        for step in range(steps):
            kill.now(step)
            train_step(model, optimizer, seed, step)
            if (step + 1) % every == 0:
                kill.now(step + 1, saving=True)
                ft.save(checkpoints, step + 1, model, optimizer)
    return {"files": files_of(checkpoints), "lost": lost.error is not None}


def restarted_in_world(folder, seed, steps, every, files, where):
    ft, checkpoints, model, optimizer = begin(folder, where, seed + 1, files=files)
    path = ft.newest(checkpoints)
    found = os.path.relpath(path, checkpoints) if isinstance(path, str) else repr(path)
    start, error = -1, ""
    try:
        start = ft.load(path, model, optimizer) if path is not None else 0
    except Exception as raised:  # noqa: BLE001 - what the judge names: a torn checkpoint loaded
        error = f"{type(raised).__name__}: {raised}"
    if not fits(optimizer, not error):
        return {"start": start, "error": error or MISFIT, "found": found, "params": flat(model)}
    for step in range(start, steps):
        train_step(model, optimizer, seed, step)
        if (step + 1) % every == 0:
            ft.save(checkpoints, step + 1, model, optimizer)
    return {"start": start, "error": "", "found": found, "params": flat(model)}


def killed_then_restarted(impl_dir, seed, kill, steps, every):
    """The survivors' checkpoints of a world of 3 where kill happens, loaded by a world of 2 that goes on to steps."""
    expect = maybe({"files": keyed(tensor(dtype=torch.uint8)), "lost": bool})
    died = world(killed_in_world, 3, impl_dir, seed, steps, every, kill, token(), expect=expect, debug=False,
                 fresh=True, deaths=(kill.rank,))  # fmt: skip
    assert died[kill.rank] is None, said(
        "the planned death did not happen", f"{kill} was planned, and the rank did not die (its result came back)"
    )
    files = next(result["files"] for result in died if result is not None)
    expect = {"start": int, "error": str, "found": str, "params": tensor([N])}
    return world(restarted_in_world, 2, impl_dir, seed, steps, every, files, token(), expect=expect)


def judge_restart(got, seed, kill, steps, start):
    what = f"{kill}, in a world of 3 ranks with a checkpoint every 3 steps, then a restart on 2 ranks"
    for rank, result in enumerate(got):
        found = f"rank {rank}'s newest() found {result['found']!r}"
        assert result["error"] != MISFIT, said(
            "the loaded state not of the shard's size", f"{what}: rank {rank}: {MISFIT}"
        )
        if kill.in_save:
            assert not result["error"], said(
                "a load that fails after a death in a save",
                f"{what}: {found}, and load raised on it: {result['error']}. Either that checkpoint was torn by the death"
                " (a save must make it visible only once every rank's shard is written), or load fails on whole"
                " checkpoints too (test_round_trip and test_reshard load whole ones)",
            )
        assert not result["error"], said(
            "load fails on a whole checkpoint",
            f"{what}: {found}, which every rank had finished saving, and load raised on it: {result['error']}",
        )
        assert result["start"] <= start, said(
            "a torn checkpoint loaded",
            f"{what}: {found} and went on from step {result['start']}, where the newest whole checkpoint is step"
            f" {start}'s: a save that the death cut short became visible, or newest() took a folder that is not a"
            " whole checkpoint",
        )
        assert result["start"] == start, said(
            "not the newest whole checkpoint",
            f"{what}: {found} and went on from step {result['start']}, where the newest whole checkpoint is step"
            f" {start}'s: the steps between were done again",
        )
        apart = (result["params"] - uninterrupted(seed, steps)).abs().max().item()
        assert apart < 1e-9, said(
            "a restart that does not end where the uninterrupted run does",
            f"{what}: after step {steps - 1} the parameters are {apart:.3g} from those of a run that never stopped",
        )


@pytest.mark.points(6)
def test_killed_at_a_step(impl_dir):
    """A rank killed at a drawn step: the restart on fewer ranks goes on from the newest checkpoint and ends as if no death."""
    g = drawn(21)
    seed, step, rank = seed_from(g), seed_from(g, 4, 11), seed_from(g, 0, 3)
    kill = Kill(rank, step)
    got = killed_then_restarted(impl_dir, seed, kill, 13, 3)
    judge_restart(got, seed, kill, 13, step // 3 * 3)


@pytest.mark.points(6)
def test_killed_in_a_save(impl_dir):
    """A rank killed as the ranks save: no checkpoint of that save is loaded, and the restart saves that step again."""
    g = drawn(22)
    seed, rank = seed_from(g), seed_from(g, 1, 3)
    kill = Kill(rank, 6, in_save=True)
    got = killed_then_restarted(impl_dir, seed, kill, 10, 3)
    judge_restart(got, seed, kill, 10, 3)
