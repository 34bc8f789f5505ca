"""Exercise 17: a rank dies and training goes on, from a sharded checkpoint.

    python ft.py --world-size 3 --kill 1@10                  # rank 1 dies at step 10; 3 ranks start again
    python ft.py --world-size 4 --kill 1@10 --restart-on 3   # 3 ranks take over: the checkpoint is resharded
    python ft.py --world-size 3 --kill 2@12 --in-save        # rank 2 dies as the ranks save step 12's checkpoint

At scale a rank fails every few hours: a machine loses its power, the kernel's out-of-memory killer
ends a process. Its peers then wait in a collective that will never end, and the job stops. It
starts again from its newest checkpoint, on the same number of ranks or on those that are left,
as torchrun's elastic agent does: every step since that checkpoint is lost, and done again.

Every rank holds the whole model (data parallel, its rows of every batch) and Adam's state for
its shard of the model's flat parameters only (exercise 11's ZeRO-1: ShardedAdam). So a
checkpoint is sharded too: each rank writes its shard of the parameters and of Adam's state, and
no rank writes the whole. Three things make it safe to restart from:

- It becomes visible only once whole: written aside, then renamed, in one step, once every
  shard is on disk. A rank that dies in the middle of a save leaves no checkpoint, not a torn one.
- The newest one is found by its step, and only whole ones are read.
- It loads on any number of ranks: each rank takes its new shard from the old shards that overlap it.

The script runs the world with its planned death, restarts it from the newest checkpoint, and
prints its loss beside an uninterrupted run's. The model is in float64, so that a run on 2 ranks
and one on 3 agree to about 1e-16: a difference is a mistake, not rounding. Handout:
exercises/17_ft.md.
"""

import json
import os
import re
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from course.faults import kill_flag, until_a_peer_dies
from course.flags import whole
from course.launch import launch, launch_options
from course.runtime.env import external_world
from mlp import MLP, batches, config_from, gen_dataset, make_parser, split_dataset


def shard_range(n: int, rank: int, world_size: int) -> tuple:
    """The range [lo, hi) of n elements that a rank holds: torch.chunk's split, the one DTensor's Shard(0)
    and so torch.distributed.checkpoint make (10 on 4 ranks: 3, 3, 3, 1)."""
    size = -(-n // world_size)
    lo = min(rank * size, n)
    return lo, min(lo + size, n)


class ShardedAdam:
    """Adam on this rank's shard of the model's flat parameters, [lo, hi) (exercise 11's ZeRO-1): the rank
    keeps Adam's state for its shard only, steps it, and all-gathers the world's new shards into its model.
    Its state is ``shard`` (the parameters' shard, an nn.Parameter) and ``adam.state[shard]``: "step",
    "exp_avg" and "exp_avg_sq"."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        self.model, self.n = model, sum(p.numel() for p in model.parameters())
        self.lo, self.hi = shard_range(self.n, dist.get_rank(), dist.get_world_size())
        self.shard = nn.Parameter(parameters_to_vector(model.parameters()).detach()[self.lo : self.hi].clone())
        self.adam = torch.optim.Adam([self.shard], lr=lr)

    def step(self) -> None:
        self.shard.grad = parameters_to_vector(p.grad for p in self.model.parameters())[self.lo : self.hi]
        self.adam.step()
        size = -(-self.n // dist.get_world_size())  # gloo gathers pieces of one size: each padded to the largest
        gathered = self.shard.new_empty(size * dist.get_world_size())
        dist.all_gather_into_tensor(gathered, F.pad(self.shard.detach(), (0, size - (self.hi - self.lo))))
        vector_to_parameters(gathered[: self.n], self.model.parameters())


def backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The backward of this rank's rows (x, y) of a batch of batch_size rows, after which every rank's
    gradients are those of the mean cross-entropy over the whole batch, whatever the world size. Sum
    them over the ranks with all_reduce. Returns this rank's part of the batch's mean loss (the parts of
    every rank sum to it)."""
    # TODO(exercise 17): a loss whose gradients, summed over the ranks, are the whole batch's mean's.
    ### BEGIN SOLUTION
    logits, _ = model(x)
    loss = F.cross_entropy(logits, y, reduction="sum") / batch_size
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    return loss.detach()
    ### END SOLUTION


def save(folder: str, step: int, model: nn.Module, optimizer: ShardedAdam) -> None:
    """Save the checkpoint of `step` (the steps done so far) in folder, called on every rank. Each rank
    writes its shard: optimizer.shard, Adam's state of it ("step", "exp_avg", "exp_avg_sq") and where it
    lies (lo, hi); one rank writes what the checkpoint is (its step, its world size). It becomes visible
    in folder only once every rank's shard is written, in one step; a rank that dies at any moment of a
    save leaves no checkpoint that newest() finds."""
    # TODO(exercise 17): the shards written aside; when all are written (barrier), one rank makes it visible.
    ### BEGIN SOLUTION
    rank = dist.get_rank()
    aside = os.path.join(folder, f".step{step}.partial")
    os.makedirs(aside, exist_ok=True)  # a save torn by a death may have left it
    adam = optimizer.adam.state[optimizer.shard]
    shard = {"lo": optimizer.lo, "hi": optimizer.hi, "param": optimizer.shard.detach()}
    shard |= {key: adam[key] for key in ("step", "exp_avg", "exp_avg_sq")}
    torch.save(shard, os.path.join(aside, f"rank{rank}.pt"))
    dist.barrier()  # every shard is on disk before the checkpoint says it is whole
    if rank == 0:
        with open(os.path.join(aside, "manifest.json"), "w") as f:
            json.dump({"step": step, "world_size": dist.get_world_size()}, f)
        os.rename(aside, os.path.join(folder, f"step{step}"))  # visible now, whole: a rename is atomic
    dist.barrier()  # no rank goes on until it is
    ### END SOLUTION


def newest(folder: str) -> str | None:
    """The path of folder's newest checkpoint, by its step, that save() made visible; None where there is none."""
    # TODO(exercise 17): the visible checkpoints' steps, as numbers; the largest.
    ### BEGIN SOLUTION
    steps = [int(m[1]) for m in (re.fullmatch(r"step(\d+)", name) for name in os.listdir(folder)) if m]
    return os.path.join(folder, f"step{max(steps)}") if steps else None
    ### END SOLUTION


def load(path: str, model: nn.Module, optimizer: ShardedAdam) -> int:
    """Load the checkpoint at path, saved on any number of ranks, called on every rank: the model's whole
    parameters, and this rank's shard [optimizer.lo, optimizer.hi) of them and of Adam's state (its step,
    exp_avg, exp_avg_sq), taken from the saved shards that overlap it. Returns the checkpoint's step."""
    # TODO(exercise 17): every saved shard read; the whole parameters; this rank's piece of each overlapping shard.
    ### BEGIN SOLUTION
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    shards = [torch.load(os.path.join(path, f"rank{r}.pt"), weights_only=True) for r in range(manifest["world_size"])]
    vector_to_parameters(torch.cat([s["param"] for s in shards]), model.parameters())
    lo, hi = optimizer.lo, optimizer.hi

    def mine(key):
        return torch.cat([s[key][max(lo, s["lo"]) - s["lo"] : max(0, min(hi, s["hi"]) - s["lo"])] for s in shards])

    with torch.no_grad():
        optimizer.shard.copy_(mine("param"))
    optimizer.adam.state[optimizer.shard] = {"step": shards[0]["step"].clone()}
    optimizer.adam.state[optimizer.shard] |= {key: mine(key) for key in ("exp_avg", "exp_avg_sq")}
    return manifest["step"]
    ### END SOLUTION


def torch_checkpoint(folder: str, step: int, optimizer: ShardedAdam, restore: bool = False) -> float | None:
    """torch's version (--compare): torch.distributed.checkpoint saves this rank's shard of the parameters and
    of Adam's state as DTensors split as shard_range splits them (Shard(0)), beside the checkpoint of `step`; or,
    with restore, loads them on this world, resharded by torch, and returns how far they are from what load() gave."""
    # Imported here: torch.distributed.checkpoint takes about 1 s to import, which a run without --compare skips.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    adam = optimizer.adam.state[optimizer.shard]
    ours = {"param": optimizer.shard.detach(), "exp_avg": adam["exp_avg"], "exp_avg_sq": adam["exp_avg_sq"]}

    def spread(local):
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(optimizer.n,), stride=(1,))

    where = os.path.join(folder, f"dcp{step}")
    if not restore:
        dcp.save({key: spread(value) for key, value in ours.items()}, checkpoint_id=where)
        return None
    theirs = {key: spread(torch.empty_like(value)) for key, value in ours.items()}
    dcp.load(theirs, checkpoint_id=where)
    return max((theirs[key].to_local() - ours[key]).abs().max().item() for key in ours)


def train(config, folder: str, every: int, kill=None, compare: bool = False) -> dict:
    """Train from folder's newest checkpoint (from the start where there is none) to step config.niters,
    saving one every `every` steps; `kill` (course/faults.py's Kill) plans a death; with compare, torch's
    checkpoint of the same states is saved beside ours, and loaded beside it. A peer's death ends the
    training: what was done comes back, with when the death was seen."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.seed)
    model = MLP(config).double()
    optimizer = ShardedAdam(model, config.lr)
    path = newest(folder)
    start = load(path, model, optimizer) if path is not None else 0
    torch_apart = torch_checkpoint(folder, start, optimizer, restore=True) if compare and path is not None else None
    train_set, _ = split_dataset(*gen_dataset(config, rand_state=config.seed))
    rows = config.batch_size // world_size
    losses, first_step_at = {}, None
    with until_a_peer_dies() as lost:
        for step, x, y in batches(train_set[0].double(), train_set[1], config.batch_size, config.seed):
            if step == config.niters:
                break
            if step < start:  # the checkpoint's batches are done: the data goes on where it stopped
                continue
            if kill is not None:
                kill.now(step)
            model.zero_grad(set_to_none=True)
            mine = slice(rank * rows, (rank + 1) * rows)
            loss = backward(model, x[mine], y[mine], config.batch_size)
            optimizer.step()
            dist.all_reduce(loss)  # the batch's loss, for the record
            losses[step] = loss.item()
            first_step_at = first_step_at or time.time()
            if (step + 1) % every == 0:
                if kill is not None:
                    kill.now(step + 1, saving=True)
                save(folder, step + 1, model, optimizer)
                if compare:
                    torch_checkpoint(folder, step + 1, optimizer)
    params = parameters_to_vector(model.parameters()).detach()
    return {"start": start, "losses": losses, "first_step_at": first_step_at, "lost_at": lost.when,
            "lost": lost.error, "params": params if rank == 0 else None, "torch_apart": torch_apart}  # fmt: skip


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--kill", type=kill_flag, metavar="RANK@STEP", help="that rank dies as that step starts")
    parser.add_argument("--in-save", action="store_true", help="--kill's rank dies as the ranks save that step")
    parser.add_argument(
        "--restart-on", type=whole(1), metavar="RANKS", help="the world that restarts (default: the same)"
    )
    parser.add_argument("--every", type=whole(1), default=4, help="steps between checkpoints")
    parser.add_argument("--checkpoints", metavar="FOLDER", help="where they go (default: a new temporary folder)")
    parser.add_argument(
        "--compare", action="store_true", help="torch.distributed.checkpoint saves and reshards the same states beside"
    )
    parser.set_defaults(niters=40, n_layers=3, dim_in=9, dim_hidden=11, n_classes=3, batch_size=24, learning_rate=0.01)
    args = parser.parse_args()
    if external_world() is not None:
        parser.error(
            "ft.py starts its worlds again itself, as torchrun's elastic agent would: run it as python ft.py, not under"
            " a launcher (under torchrun --max-restarts, train() resumes from the newest checkpoint at each start)"
        )
    if args.device not in (None, "cpu") or args.backend == "nccl":
        parser.error("ft.py runs on the CPU with gloo: its model is small, and what it shows is in its files")
    args.device = "cpu"
    kill = args.kill
    if kill is not None:
        kill = type(kill)(kill.rank, kill.step, args.in_save)
        if kill.rank >= args.world_size:
            parser.error(f"--kill {kill.rank}@{kill.step}: there are ranks 0 to {args.world_size - 1}")
        if kill.step >= args.niters:
            parser.error(f"--kill {kill.rank}@{kill.step}: the run has steps 0 to {args.niters - 1} (--niters)")
        if args.in_save and (kill.step % args.every or kill.step == 0):
            parser.error(
                f"--kill {kill.rank}@{kill.step} --in-save: step {kill.step} saves no checkpoint (--every {args.every})"
            )
    restart_on = args.restart_on or args.world_size
    for ranks in {args.world_size, restart_on}:
        if args.batch_size % ranks:
            parser.error(f"--batch-size {args.batch_size} does not divide over {ranks} ranks")
    config = config_from(args)
    folder = args.checkpoints or tempfile.mkdtemp(prefix="ft-")
    os.makedirs(folder, exist_ok=True)
    earlier = newest(folder)
    if earlier is not None:
        print(f"{folder} holds checkpoints already: the first world goes on from {earlier}")
    options = launch_options(args)
    deaths = (kill.rank,) if kill else ()
    first = launch(train, args.world_size, config, folder, args.every, kill, args.compare, deaths=deaths, **options)
    survivor = next(r for r in first if r is not None)
    print(f"{args.world_size} ranks, a checkpoint every {args.every} steps in {folder}")
    if survivor["lost"] is not None:
        print(f"{kill}: the others saw it in a collective: {survivor['lost']}")
    path = newest(folder)
    print(f"newest checkpoint: {path}; in the folder: {sorted(os.listdir(folder))}")
    again = launch(train, restart_on, config, folder, args.every, None, args.compare, **options)
    if survivor["lost_at"] is not None:
        print(
            f"restarted on {restart_on} ranks from step {again[0]['start']}: the first step after the death"
            f" {again[0]['first_step_at'] - survivor['lost_at']:.2f} s after it was seen"
        )
    if args.compare and again[0]["start"]:
        print(
            f"torch.distributed.checkpoint, saved beside on {args.world_size} ranks and loaded on {restart_on}: the"
            f" ranks' shards at most {max(r['torch_apart'] for r in again):.1e} from what load() gave"
        )
    alone = launch(train, restart_on, config, tempfile.mkdtemp(prefix="ft-"), config.niters + 1, **options)
    ran, reference = {**survivor["losses"], **again[0]["losses"]}, alone[0]["losses"]
    for step in sorted(ran):
        if step % 5 == 0 or step == config.niters - 1:
            print(f"step {step} | loss {ran[step]:.6f} | uninterrupted {reference[step]:.6f}")
    apart = (again[0]["params"] - alone[0]["params"]).abs().max().item()
    print(f"final parameters: {apart:.1e} apart from the uninterrupted run's")
