"""An all-to-all next to an all-reduce of the same bytes, measured and predicted by exercise 12's model: `make bench-ep`.

    make bench-ep                        # the reference solutions
    COURSE_IMPL=student make bench-ep    # your own moe.py and cost.py

On 2 and 4 ranks (gloo, no collective checking), for 64 KiB to 4 MiB per rank in rows of 1 KiB (a
token of 256 floats), it times, taken in turns (bench/common.py's interleaved):
- even: the forward of exercise 18's AllToAll, every rank sending 1/p of its rows to each rank;
- uneven: the same, rank 0 getting twice its even share of every rank's rows, the others sharing the
  rest (half the rows on 4 ranks; all of them on 2, where half is the even share): one hot expert;
- all-reduce: dist.all_reduce of the same bytes.
Each is the slowest rank's median of 80 calls, and its fastest (the JSON has both).
Then exercise 12's model predicts each, from alpha and beta that fit_alpha_beta fits on the fastest
ping-pongs between ranks 0 and 1 (1 KiB to 1 MiB) in the same world:
- an all-to-all: p - 1 messages, and the bytes of the busiest rank's link, the more of what it sends
  to and receives from the others: (p - 1) / p of n when even, twice that with the hot rank;
- an all-reduce: ring_allreduce_seconds, 2(p - 1) steps of n / p bytes.
Where exercise 12 is not written the times are measured and the prediction is left out, with the
reason. Writes bench/ep.json and, with matplotlib, bench/ep.png.
"""

import os
from functools import partial

import torch
import torch.distributed as dist
from common import Record, interleaved, side_by_side

from course import impl
from course.launch import bench, run

WORLD_SIZES = (2, 4)
BYTES = [2**k for k in range(16, 23, 2)]  # per rank, 64 KiB to 4 MiB, as bench/cost.py's all-reduces
SIZES = [2**k for k in range(10, 21, 2)]  # ping-pongs, 1 KiB to 1 MiB, as exercise 12
WIDTH = 256
ROW_BYTES = 4 * WIDTH
ALL_TO_ALLS = {"even": False, "uneven": True}  # whether rank 0 is hot
KINDS = (*ALL_TO_ALLS, "all-reduce")
# The median, and the fastest call: other programs on the machine only ever add time (bench/common.py).
STATISTICS = ("median", "fastest")


def splits(rows, world_size, hot):
    """blocks[s][r]: how many of rank s's rows go to rank r. Even; or, `hot`, rank 0 gets twice its even share
    and the others share the rest; a remainder stays on its rank, where it crosses no link."""
    first = (2 if hot else 1) * rows // world_size
    other = (rows - first) // (world_size - 1)
    blocks = []
    for s in range(world_size):
        row = [first] + [other] * (world_size - 1)
        row[s] += rows - sum(row)
        blocks.append(row)
    return blocks


def exchanges(ex, n):
    """The three collectives of n bytes on this rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = torch.zeros(n // ROW_BYTES, WIDTH)
    out = {}
    for kind, hot in ALL_TO_ALLS.items():
        blocks = splits(len(x), world_size, hot)
        out[kind] = partial(ex.moe.AllToAll.apply, x, blocks[rank], [row[rank] for row in blocks], None)
    out["all-reduce"] = partial(dist.all_reduce, torch.zeros(n // 4))
    return out


def measure(folder, rounds, per_round):
    """On every rank of one world: the ping-pongs, and each collective's fastest and median (seconds, the slowest
    rank's)."""
    ex = impl.load(folder)
    out = {"message": [ex.cost.message_seconds(n) for n in SIZES]}
    functions = {(n, kind): fn for n in BYTES for kind, fn in exchanges(ex, n).items()}
    fastest, median = interleaved(functions, rounds, per_round)
    out["timed"] = rounds * per_round
    out["bytes"] = {
        n: {kind: {"median": median[n, kind], "fastest": fastest[n, kind]} for kind in KINDS} for n in BYTES
    }
    return out


def all_to_all_seconds(blocks, alpha, beta):
    """Exercise 12's model of an all-to-all of blocks[s][r] rows: p - 1 messages, and the busiest rank's bytes.
    A rank's link carries what it sends and what it receives at once, as in each of the ring's steps."""
    p = len(blocks)
    sent = [sum(row) - row[s] for s, row in enumerate(blocks)]
    received = [sum(row[r] for row in blocks) - blocks[r][r] for r in range(p)]
    return (p - 1) * alpha + max(sent + received) * ROW_BYTES / beta


def predict(cost, figures, world_size):
    alpha, beta = cost.fit_alpha_beta(SIZES, figures["message"])
    predicted = {}
    for n in BYTES:
        rows = n // ROW_BYTES
        predicted[n] = {
            kind: all_to_all_seconds(splits(rows, world_size, hot), alpha, beta) for kind, hot in ALL_TO_ALLS.items()
        }
        predicted[n]["all-reduce"] = cost.ring_allreduce_seconds(n, world_size, alpha, beta)
    return {"alpha_s": alpha, "beta_bytes_per_s": beta, "predicted": predicted}


def spread(values):
    """The smallest and the largest of values, or the one figure they all round to."""
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return low if low == high else f"{low} to {high}"


def world_lines(w, got):
    """One world's table: each size's median and fastest call, with exercise 12's prediction and measured /
    predicted where there is one; then what an all-reduce, and the hot rank, cost against the even all-to-all."""
    predicted = got.get("predicted")
    columns = ("measured", "predicted", "ratio") if predicted else ("measured",)
    fitted = (
        f"alpha {got['alpha_s'] * 1e6:.0f} us, beta {got['beta_bytes_per_s'] / 1e9:.2f} GB/s; " if predicted else ""
    )
    lines = [
        f"W={w}: {fitted}ms, of {got['timed']} calls each, the slowest rank's",
        f"  {'':>17}" + "".join(f"{kind:>{10 * len(columns) + 3}}" for kind in KINDS),
        f"  {'per rank':>17}" + f"{'':>3}{''.join(f'{c:>10}' for c in columns)}" * len(KINDS),
    ]
    for n in BYTES:
        for statistic in STATISTICS:
            cells = []
            for kind in KINDS:
                measured = got["bytes"][n][kind][statistic]
                cells.append(f"{'':>3}{measured * 1e3:10.2f}")
                if predicted:
                    cells.append(f"{predicted[n][kind] * 1e3:10.2f}{measured / predicted[n][kind]:10.2f}")
            size = f"{n // 1024} KiB" if statistic == STATISTICS[0] else ""
            lines.append(f"  {size:>9}{statistic:>8}" + "".join(cells))
    for over in ("all-reduce", "uneven"):
        said = [
            f"{s} {spread([got['bytes'][n][over][s] / got['bytes'][n]['even'][s] for n in BYTES])}" for s in STATISTICS
        ]
        if predicted:
            said.append(f"predicted {spread([predicted[n][over] / predicted[n]['even'] for n in BYTES])}")
        lines.append(f"  {over} / even: " + ", ".join(said))
    return lines


def summary(results, why=""):
    lines = [line for w, got in results.items() for line in world_lines(w, got)]
    lines.append("even: every rank sends 1/W of its rows to each; uneven: rank 0 gets twice its even share of them")
    if why:
        lines.append(f"no prediction: it is exercise 12's model, and {why}")
    return "\n".join(lines)


def draw(ax, w, got):
    """One world's panel: each collective by size, its median and fastest call, and where there is one, its
    prediction."""
    for kind, colour in zip(KINDS, ("tab:blue", "tab:orange", "tab:green")):
        for statistic, style in zip(STATISTICS, ("o-", "x:")):
            measured = [got["bytes"][n][kind][statistic] * 1e3 for n in BYTES]
            ax.plot(BYTES, measured, style, color=colour, label=f"{kind}, {statistic}")
        if "predicted" in got:
            predicted = [got["predicted"][n][kind] * 1e3 for n in BYTES]
            ax.plot(BYTES, predicted, "--", color=colour, label=f"{kind}, predicted")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("ms")
    ax.set_title(
        f"all-to-all (exercise 18) and all-reduce on {w} ranks (gloo, this machine);\n"
        "uneven: rank 0 gets twice its even share of every rank's rows",
        fontsize=9,
    )


def main(rounds=16, per_round=5):
    folder = impl.selected()
    record = Record("ep")
    results = {w: run(measure, w, folder, rounds, per_round, debug=False)[0] for w in WORLD_SIZES}
    cost, why = impl.load(folder).cost, ""
    try:
        for w, got in results.items():
            got |= predict(cost, got, w)
    except NotImplementedError as stub:  # exercise 12 not written: what is measured still is
        why = str(stub)
    record.write(
        summary(results, why),
        {"implementation": os.path.relpath(folder), "results": results},
        partial(side_by_side, results, draw=draw),
    )


if __name__ == "__main__":
    bench(main)
