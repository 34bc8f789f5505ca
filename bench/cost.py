"""Exercise 12's cost model against this machine: `make bench-cost`.

    make bench-cost                       # the reference solutions
    COURSE_IMPL=student make bench-cost   # your own cost.py and mydp.py

On 2 ranks (gloo, the default MLP, batches of 64 rows) it measures T_comp (forward, backward and
step of the model alone; and of batches of 16 to 256 rows), the time of one message of 1 KiB to
1 MiB (the fastest of 30 ping-pongs between ranks 0 and 1), the step time of MyDP (exercise 4)
and of OverlappedDP with 1 MiB buckets (exercise 6), and, in one recorded OverlappedDP step, when
each bucket's gradients were all computed. On 2 and 4 ranks it times all-reduces of 64 KiB to
4 MiB with gloo and with the ring of exercise 5. Then exercise 12's functions fit alpha and beta
and predict:
- MyDP: T_comp plus one ring all-reduce per parameter, one after the other;
- OverlappedDP: T_comp plus the exposed time of its buckets, from their ready times;
- each all-reduce measured, as the ring's cost;
- the speed-up for W = 1, 2, 4, and the largest R for which T_sync / T_comp < R - 1.
Prints predicted against measured with the error of each prediction, and writes bench/cost.json
and, with matplotlib, bench/cost.png.
"""

import json
import os
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist
from common import pyplot, slowest_rank

from course import impl, timeline
from course.launch import bench, run

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD_SIZE = 2
BUCKET_MB = 1
SIZES = [2**k for k in range(10, 21, 2)]  # 1 KiB to 1 MiB
STEPS = 15
BATCHES = (16, 32, 64, 128, 256)
ALLREDUCE_SIZES = [2**k for k in range(16, 23, 2)]  # 64 KiB to 4 MiB


def median_step(step) -> float:
    """The median of STEPS timed calls after two untimed ones, the slowest rank's (a step ends for all)."""
    for _ in range(2):
        step()
    times = []
    for _ in range(STEPS):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return slowest_rank(statistics.median(times))


def allreduce_times(folder: str) -> dict:
    """Run on every rank: the median time of gloo's all-reduce and of exercise 5's ring, by size."""
    ring = impl.load(folder).dist.ring_all_reduce
    out = {}
    for name, reduce in (("gloo", dist.all_reduce), ("ring", ring)):
        out[name] = [median_step(lambda n=n, r=reduce: r(torch.zeros(n // 4))) for n in ALLREDUCE_SIZES]
    return out


def on_ranks(folder: str) -> dict:
    """Run on every rank: everything the model needs, and the steps it predicts, measured."""
    ex = impl.load(folder)
    config = ex.mlp.ModelConfig()
    x, y = torch.randn(config.batch_size, config.d_in), torch.randint(0, config.n_classes, (config.batch_size,))

    def trainer(wrap):
        torch.manual_seed(0)
        model = ex.mlp.MLP(config)
        model = wrap(model) if wrap else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            optimizer.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
            optimizer.step()

        return step

    overlapped = partial(ex.mydp.OverlappedDP, bucket_cap_mb=BUCKET_MB)
    by_batch = {}
    for rows in BATCHES:  # T_comp of the model alone, by batch size
        torch.manual_seed(0)
        alone, data = ex.mlp.MLP(config), torch.randn(rows, config.d_in)
        labels = torch.randint(0, config.n_classes, (rows,))
        by_batch[rows] = median_step(lambda m=alone, d=data, t=labels: m(d, t)[1].backward())
    figures = {
        "t_comp_by_batch": by_batch,
        "t_comp": median_step(trainer(None)),
        "message": [ex.cost.message_seconds(n) for n in SIZES],
        "grad_bytes": [p.numel() * p.element_size() for p in ex.mlp.MLP(config).parameters()],
        "measured": {"MyDP": median_step(trainer(ex.mydp.MyDP)), "OverlappedDP": median_step(trainer(overlapped))},
    }
    # When each bucket's last gradient was computed, from the start of the backward pass.
    events = timeline.record_step(partial(ex.mlp.MLP, config), overlapped, x, y)
    (backward,) = [e for e in events if e["kind"] == "backward"]
    computed = {e["label"]: e["start"] - backward["start"] for e in events if e["kind"] == "grad"}
    model = ex.mlp.MLP(config)
    names = {id(p): name for name, p in model.named_parameters()}
    buckets = ex.mydp.bucket_parameters(list(model.parameters()), int(BUCKET_MB * 2**20))
    figures["buckets"] = [
        {"ready": max(computed[names[id(p)]] for p in bucket), "bytes": sum(p.numel() * 4 for p in bucket)}
        for bucket in buckets
    ]
    figures["backward"] = backward["end"] - backward["start"]
    return figures


def predict(cost, figures: dict, allreduces: dict) -> dict:
    alpha, beta = cost.fit_alpha_beta(SIZES, figures["message"])

    def sync_of(ranks):  # MyDP: one ring all-reduce per parameter, one after the other
        return sum(cost.ring_allreduce_seconds(n, ranks, alpha, beta) for n in figures["grad_bytes"])

    buckets = figures["buckets"]
    exposed = cost.exposed_seconds(
        [b["ready"] for b in buckets], [b["bytes"] for b in buckets], figures["backward"], WORLD_SIZE, alpha, beta
    )
    return {
        "alpha_s": alpha,
        "beta_bytes_per_s": beta,
        "predicted": {"MyDP": figures["t_comp"] + sync_of(WORLD_SIZE), "OverlappedDP": figures["t_comp"] + exposed},
        "allreduce_predicted": {
            w: [cost.ring_allreduce_seconds(n, w, alpha, beta) for n in ALLREDUCE_SIZES] for w in allreduces
        },
        "speedup": {w: cost.speedup(figures["t_comp"], sync_of(w), w) for w in (1, 2, 4)},
        "largest_world": cost.largest_world(figures["t_comp"], sync_of),
    }


def plot(results: dict, path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    names = list(results["measured"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    positions = range(len(names))
    ax.bar([p - 0.2 for p in positions], [results["predicted"][n] * 1e3 for n in names], 0.4, label="predicted")
    ax.bar([p + 0.2 for p in positions], [results["measured"][n] * 1e3 for n in names], 0.4, label="measured")
    ax.set_xticks(list(positions), names)
    ax.set_ylabel("ms per step")
    ax.set_title(f"one step of the default MLP on {WORLD_SIZE} ranks (gloo, this machine)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main():
    folder = impl.selected()
    load = os.getloadavg()[0]
    figures = run(on_ranks, WORLD_SIZE, folder)[0]
    allreduces = {w: run(allreduce_times, w, folder)[0] for w in (2, 4)}
    results = figures | {"allreduce": allreduces, "allreduce_sizes": ALLREDUCE_SIZES}
    results |= predict(impl.load(folder).cost, figures, allreduces) | {"load_average": [load, os.getloadavg()[0]]}
    print(f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after; {WORLD_SIZE} ranks, default MLP")
    print(f"fitted: alpha {results['alpha_s'] * 1e6:.0f} us, beta {results['beta_bytes_per_s'] / 1e9:.2f} GB/s")
    print(f"T_comp {figures['t_comp'] * 1e3:.2f} ms; forward and backward by batch size: ", end="")
    print(", ".join(f"{rows}: {t * 1e3:.2f} ms" for rows, t in figures["t_comp_by_batch"].items()))
    print(f"{'all-reduce':>14}  {'predicted':>9}  {'gloo':>8}  {'ring':>8}")
    for w, times in allreduces.items():
        for i, n in enumerate(ALLREDUCE_SIZES):
            predicted = results["allreduce_predicted"][w][i]
            print(
                f"{f'{n // 1024} KiB, W={w}':>14}  {predicted * 1e3:7.2f}ms  {times['gloo'][i] * 1e3:6.2f}ms"
                f"  {times['ring'][i] * 1e3:6.2f}ms"
            )
    print(f"{'step':>14}  {'predicted':>9}  {'measured':>8}  {'error':>6}")
    for name, measured in results["measured"].items():
        predicted = results["predicted"][name]
        print(f"{name:>14}  {predicted * 1e3:7.2f}ms  {measured * 1e3:6.2f}ms  {predicted / measured - 1:+6.0%}")
    print("predicted speed-up of MyDP:", ", ".join(f"W={w}: {s:.2f}x" for w, s in results["speedup"].items()))
    largest = results["largest_world"]
    print(f"largest R with T_sync / T_comp < R - 1: {largest}" + (" (every R tried)" if largest == 1024 else ""))
    with open(os.path.join(HERE, "cost.json"), "w") as f:
        json.dump(results, f, indent=1)
    drawn = plot(results, os.path.join(HERE, "cost.png"))
    print("wrote bench/cost.json" + (" and bench/cost.png" if drawn else " (no matplotlib: no plot)"))


if __name__ == "__main__":
    bench(main)
