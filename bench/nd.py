"""Three meshes of 4 ranks, measured and predicted by exercise 12's model: `make bench-nd`.

    make bench-nd                        # the reference solutions
    COURSE_IMPL=student make bench-nd    # your own nd.py and cost.py

In one world of 4 ranks (gloo, the default MLP: 1024 -> 256 -> 256 -> 256 -> 32, no collective
checking), for a batch of ROWS rows in all, it times one training step of exercise 16's train_step
on the meshes (4, 1), (2, 2) and (1, 4), taken in turns (bench/common.py's interleaved), and counts
each rank's bytes of parameters and gradients. Then exercise 12's model predicts each step, from
figures taken in the same world:
- T_comp: this rank's blocks of the weights alone on its B / dp rows, forward, backward and SGD,
  without a collective, every rank at once (they share the cores);
- alpha and beta: fit_alpha_beta on the fastest ping-pongs between ranks 0 and 1, 1 KiB to 1 MiB;
- dp: per layer, an all-gather of its block forward and a reduce-scatter of its gradient backward
  in the dp group, together one ring all-reduce of the block's bytes on dp ranks;
- tp: per block, a ring all-reduce on tp ranks of its output forward and of its input gradient
  backward (B / dp rows; the first block's input, the data, needs none).
The prediction's fastest mesh is set against the measured one, and the output says what the model
leaves out. Where exercise 12 is not written (a student's copy that skipped it), the steps and bytes
are measured and the prediction is left out, with the reason. Writes bench/nd.json and, with
matplotlib, bench/nd.png.
"""

import os
from functools import partial

import torch
import torch.distributed as dist
from common import Record, interleaved, products_alone, pyplot

from course import impl
from course.launch import bench, run

MESHES = ((4, 1), (2, 2), (1, 4))
ROWS = 256
SIZES = [2**k for k in range(10, 21, 2)]  # ping-pongs, 1 KiB to 1 MiB, as exercise 12


def widths(config):
    return [config.d_in] + [config.d_hidden] * (config.n_layers - 1) + [config.n_classes]


def blocks_alone(config, tp, x, y):
    """A step of this rank's blocks of the weights on its rows, as exercise 16 runs them, without a collective:
    a column layer keeps out / tp rows of its weight, a row layer in / tp columns."""
    sizes = widths(config)
    shapes = [(b // tp, a) if i % 2 == 0 else (b, a // tp) for i, (a, b) in enumerate(zip(sizes, sizes[1:]))]
    return products_alone([torch.nn.Parameter(torch.randn(shape)) for shape in shapes], x, y)


def measure(folder, rounds, per_round):
    """On every rank of one world of 4: the ping-pongs, each mesh's step and its computation alone (seconds,
    the slowest rank's), and each rank's bytes of parameters and gradients."""
    ex = impl.load(folder)
    config = ex.mlp.ModelConfig()
    out = {"bytes": {}}
    torch.manual_seed(0)
    x, y = torch.randn(ROWS, config.d_in), torch.randint(0, config.n_classes, (ROWS,))
    functions = {}
    for dp, tp in MESHES:
        mesh = ex.nd.mesh_groups(dp, tp)
        model = ex.nd.MeshMLP(list(ex.mlp.MLP(config).layers), mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        functions[f"{dp}x{tp}"] = partial(ex.nd.train_step, model, optimizer, x, y)
        rows = slice(mesh.dp_rank * ROWS // dp, (mesh.dp_rank + 1) * ROWS // dp)
        functions[f"{dp}x{tp} compute alone"] = blocks_alone(config, tp, x[rows], y[rows])
        functions[f"{dp}x{tp}"]()
        held = [sum(p.numel() * p.element_size() for p in model.parameters())]
        held.append(sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()))
        everyone = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, torch.tensor(held))
        out["bytes"][f"{dp}x{tp}"] = [dict(zip(("parameters", "gradients"), map(int, b))) for b in everyone]
    # The pair's group after the meshes: a group ranks 2 and 3 are not in, made before groups that their members
    # alone make (use_local_synchronization), leaves those waiting for ever in torch 2.13 (pytorch#173608).
    pair = dist.new_group([0, 1])
    out["message"] = [ex.cost.message_seconds(n, pair) for n in SIZES]
    fastest, median = interleaved(functions, rounds, per_round)
    out["steps"] = {name: {"fastest": fastest[name], "median": median[name]} for name in fastest}
    out["widths"] = widths(config)
    return out


def predict(cost, figures):
    alpha, beta = cost.fit_alpha_beta(SIZES, figures["message"])
    ring = lambda n, w: cost.ring_allreduce_seconds(n, w, alpha, beta)  # noqa: E731
    sizes = figures["widths"]
    predicted = {}
    for dp, tp in MESHES:
        name = f"{dp}x{tp}"
        sync = sum(ring(4 * a * b / tp, dp) for a, b in zip(sizes, sizes[1:]))  # each layer's block, in dp
        rows = ROWS // dp
        outputs = sizes[2::2]  # each block's output, forward
        inputs = sizes[2:-1:2]  # each block's input gradient but the first's, backward
        sync += sum(ring(4 * rows * n, tp) for n in outputs + inputs)
        predicted[name] = {"compute": figures["steps"][f"{name} compute alone"]["fastest"], "sync": sync}
        predicted[name]["step"] = predicted[name]["compute"] + sync
    return {"alpha_s": alpha, "beta_bytes_per_s": beta, "predicted": predicted}


def left_out(got):
    """What the model leaves out, with this run's own figures: why the measured steps exceed the prediction."""
    names = [f"{dp}x{tp}" for dp, tp in MESHES]
    ratios = [got["steps"][n]["fastest"] / got["predicted"][n]["step"] for n in names]
    cores = len(os.sched_getaffinity(0))
    lines = [f"  measured / predicted: {min(ratios):.1f} to {max(ratios):.1f}. The model leaves out:"]
    if cores < 4:
        lines.append(
            f"  - the cores: the 4 ranks share {cores}, so every collective of a step waits for its ranks to be"
            " scheduled, where the ping-pong that fits alpha and beta ran on 2 ranks while the others idled;"
        )
    lines.append(
        "  - the work around each of the step's collectives that alpha + n / beta does not count: Python, the"
        " autograd functions, the copies into and out of the gathered blocks (docs/benchmarks.md)"
    )
    return "\n".join(lines)


def summary(got, why=""):
    """The table of the meshes: measured, and where exercise 12's model could predict (else why not), predicted."""
    names = [f"{dp}x{tp}" for dp, tp in MESHES]
    predicted = "predicted" in got
    fitted = (
        f"alpha {got['alpha_s'] * 1e6:.0f} us, beta {got['beta_bytes_per_s'] / 1e9:.2f} GB/s; " if predicted else ""
    )
    lines = [
        f"{ROWS} rows a step on 4 ranks; {fitted}fastest step in ms",
        f"  {'mesh (dp x tp)':>15}{'measured':>10}"
        + (f"{'predicted':>11}{'T_comp':>8}{'T_sync':>8}" if predicted else "")
        + f"{'params B/rank':>15}{'grads B/rank':>14}",
    ]
    for name in names:
        held, p = got["bytes"][name][0], got["predicted"][name] if predicted else None
        lines.append(
            f"  {name:>15}{got['steps'][name]['fastest'] * 1e3:10.2f}"
            + (f"{p['step'] * 1e3:11.2f}{p['compute'] * 1e3:8.2f}{p['sync'] * 1e3:8.2f}" if predicted else "")
            + f"{held['parameters']:>15}{held['gradients']:>14}"
        )
    if not predicted:
        return "\n".join([*lines, f"  no prediction: it is exercise 12's model, and {why}"])
    measured = min(names, key=lambda n: got["steps"][n]["fastest"])
    fastest = min(names, key=lambda n: got["predicted"][n]["step"])
    lines.append(f"  fastest: measured {measured}, predicted {fastest}")
    return "\n".join(lines) + "\n" + left_out(got)


def plot(got, path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    names = [f"{dp}x{tp}" for dp, tp in MESHES]
    fig, ax = plt.subplots(figsize=(6, 4))
    at = range(len(names))
    ax.bar([i - 0.2 for i in at], [got["steps"][n]["fastest"] * 1e3 for n in names], 0.4, label="measured")
    if "predicted" in got:
        ax.bar([i + 0.2 for i in at], [got["predicted"][n]["step"] * 1e3 for n in names], 0.4, label="predicted")
    ax.set_xticks(list(at), [f"dp {n.split('x')[0]} x tp {n.split('x')[1]}" for n in names])
    ax.set_ylabel("fastest step (ms)")
    ax.set_title(f"default MLP, {ROWS} rows, 4 ranks (gloo, this machine)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(rounds=8, per_round=2):
    folder = impl.selected()
    record = Record("nd")
    got = run(measure, 4, folder, rounds, per_round, debug=False)[0]
    why = ""
    try:
        got |= predict(impl.load(folder).cost, got)
    except NotImplementedError as stub:  # exercise 12 not written: what is measured still is
        why = str(stub)
    record.write(summary(got, why), {"implementation": os.path.relpath(folder), "results": got}, partial(plot, got))


if __name__ == "__main__":
    bench(main)
