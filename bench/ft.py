"""What a restart costs after a rank's death, with exercise 17's ft.py: `make bench-ft`.

    make bench-ft                        # the reference solutions
    COURSE_IMPL=student make bench-ft    # your own ft.py (and mlp.py's MLP)

For W = 2, 3 and 4 ranks, each restarting on W - 1 (the survivors), REPEAT times (default 3): the script's
model trains with a checkpoint every 4 steps, and rank 1 dies by SIGKILL as step 10 starts. A new world
then loads the newest checkpoint (step 8's) and takes its first step. From the moment a survivor saw the
death (gloo's error, in the collective that lost it), it times:
- world up: until the new world's function starts (new processes, their process group, the code loaded);
- newest + load: the model and ShardedAdam built, newest() and load();
- first step: backward() and the optimizer's step of batch 8, the first of the steps done again.
A restart also does again every step since the checkpoint (here 2): the step's time is measured too, and a
save's (5 saves of the loaded state, on the restarted world). Medians over the repeats, after one restart not
counted: its world's start imports in this process what the workers needed (torch._dynamo, which an optimizer's
first step imports: about 1 s, course/runtime/workers.py), as ft.py's own restart does. So these are restarts of
processes forked from one that imported everything; processes started afresh (torchrun's) import torch too,
seconds each. Writes bench/ft.json.
"""

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from common import Record

from course import impl
from course.faults import Kill
from course.launch import bench, run

PAIRS = ((2, 1), (3, 2), (4, 3))
EVERY, KILLED_AT = 4, 10
FIELDS = dict(n_layers=3, d_in=9, d_hidden=11, n_classes=3, batch_size=24, niters=16, lr=0.01)
PHASES = ("world up", "newest + load", "first step")


def killed(folder, checkpoints, kill):
    ex = impl.load(folder)
    return ex.ft.train(ex.mlp.ModelConfig(**FIELDS), checkpoints, EVERY, kill)


def restarted(folder, checkpoints):
    entered = time.time()
    ex = impl.load(folder)
    config = ex.mlp.ModelConfig(**FIELDS)
    torch.manual_seed(config.seed)
    model = ex.mlp.MLP(config).double()
    optimizer = ex.ft.ShardedAdam(model, config.lr)
    start = ex.ft.load(ex.ft.newest(checkpoints), model, optimizer)
    loaded = time.time()
    (x, y), _ = ex.mlp.split_dataset(*ex.mlp.gen_dataset(config, rand_state=config.seed))
    batch = next(
        (bx, by) for step, bx, by in ex.mlp.batches(x.double(), y, config.batch_size, config.seed) if step == start
    )
    size = config.batch_size // dist.get_world_size()
    rows = slice(dist.get_rank() * size, (dist.get_rank() + 1) * size)
    model.zero_grad(set_to_none=True)
    ex.ft.backward(model, batch[0][rows], batch[1][rows], config.batch_size)
    optimizer.step()
    stepped = time.time()
    saves, aside = [], tempfile.mkdtemp() if dist.get_rank() == 0 else None
    shared = [aside]
    dist.broadcast_object_list(shared)
    for n in range(5):
        began = time.perf_counter()
        ex.ft.save(shared[0], 1000 + n, model, optimizer)
        saves.append(time.perf_counter() - began)
    return {"start": start, "entered": entered, "loaded": loaded, "stepped": stepped, "save": statistics.median(saves)}


def once(folder, world_size, restart_on):
    checkpoints = tempfile.mkdtemp(prefix="bench-ft-")
    first = run(killed, world_size, folder, checkpoints, Kill(1, KILLED_AT), deaths=(1,), debug=False)
    seen = min(r["lost_at"] for r in first if r is not None and r["lost_at"] is not None)
    got = run(restarted, restart_on, folder, checkpoints, debug=False)[0]
    return {
        "world up": got["entered"] - seen,
        "newest + load": got["loaded"] - got["entered"],
        "first step": got["stepped"] - got["loaded"],
        "save": got["save"],
        "resumed at": got["start"],
    }


def main():
    folder = impl.selected()
    record = Record("ft")
    repeat = int(os.environ.get("REPEAT", "3"))
    results = {}
    once(folder, *PAIRS[0])  # not counted: see the docstring
    for world_size, restart_on in PAIRS:
        runs = [once(folder, world_size, restart_on) for _ in range(repeat)]
        results[f"{world_size} -> {restart_on}"] = {
            key: statistics.median(r[key] for r in runs) for key in (*PHASES, "save", "resumed at")
        }
    lines = [
        f"a restart after rank 1's death at step {KILLED_AT} (a checkpoint every {EVERY} steps), median of {repeat}:"
        " seconds from the death seen by a survivor",
        f"  {'ranks':>8}  {'world up':>9}  {'newest + load':>13}  {'first step':>10}  {'in all':>7}  {'a save':>8}",
    ]
    for pair, got in results.items():
        total = sum(got[phase] for phase in PHASES)
        lines.append(
            f"  {pair:>8}  {got['world up']:9.3f}  {got['newest + load']:13.3f}  {got['first step']:10.3f}"
            f"  {total:7.3f}  {got['save'] * 1000:6.1f}ms"
        )
    lines.append(f"  every restart went on from step {sorted({int(g['resumed at']) for g in results.values()})}")
    record.write("\n".join(lines), {"implementation": os.path.relpath(folder), "results": results}, lambda path: False)


if __name__ == "__main__":
    bench(main)
