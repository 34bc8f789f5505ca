# Your copy of the exercise code: fill in every TODO, then `make grade` checks it.
"""Exercise 12: a cost model of data parallelism that predicts, checked against this machine.

    python cost.py                  # measure on 2 ranks, fit, predict, and compare with a real run
    python cost.py --world-size 3   # the messages between ranks 0 and 1, the step on 3 ranks
    python cost.py --json cost.json

The model: one message of n bytes takes T(n) = alpha + n / beta (alpha: the start-up latency,
beta: the bandwidth). Synchronous data parallelism pays off when T_sync / T_comp < R - 1, with R
ranks (the condition of torch-distributed-blog.md, in this course's references).

Handout: exercises/12_cost.md.
"""

import json
import statistics
import time

import torch
import torch.distributed as dist

from course.launch import launch, launch_options
from mlp import MLP, config_from, gen_dataset, make_parser


def fit_alpha_beta(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """The latency alpha (seconds) and bandwidth beta (bytes per second) of T(n) = alpha + n / beta
    that fit the measured (sizes[i] bytes, seconds[i]) best: least squares on T, a straight line in n."""
    # TODO(exercise 12): fit the straight line T = alpha + n * (1 / beta); return (alpha, beta).
    raise NotImplementedError("Exercise 12: fit_alpha_beta is not written yet, see exercises/12_cost.md")


def ring_allreduce_seconds(n: float, world_size: int, alpha: float, beta: float) -> float:
    """The time of a ring all-reduce of n bytes on world_size ranks (exercise 5): 2(W - 1) steps,
    each a message of one chunk, n / W bytes. One rank has nothing to send."""
    # TODO(exercise 12): the ring's cost under the alpha-beta model.
    raise NotImplementedError("Exercise 12: ring_allreduce_seconds is not written yet, see exercises/12_cost.md")


def exposed_seconds(ready: list[float], sizes: list[float], backward_end: float, world_size: int, alpha, beta) -> float:
    """How long the optimizer step waits for communication after the backward pass ends.

    Bucket k's gradients are ready at time ready[k] (seconds into the backward pass, in the order
    buckets launch) and it holds sizes[k] bytes. One link: a bucket's ring all-reduce starts when
    the bucket is ready and the previous bucket's all-reduce has ended, whichever comes later.
    The exposed time is how far the last all-reduce ends after backward_end, or 0.
    """
    # TODO(exercise 12): walk the buckets in order; each starts at the later of its ready time
    # and the end of the one before.
    raise NotImplementedError("Exercise 12: exposed_seconds is not written yet, see exercises/12_cost.md")


def speedup(t_comp: float, t_sync: float, world_size: int) -> float:
    """How many times faster an epoch is on world_size ranks than on one, each rank taking batches
    of the same size: one rank takes N / B steps of t_comp, R ranks N / (R B) steps of t_comp + t_sync."""
    # TODO(exercise 12): the ratio of the two epoch times.
    raise NotImplementedError("Exercise 12: speedup is not written yet, see exercises/12_cost.md")


def largest_world(t_comp: float, t_sync_of, most: int = 1024) -> int:
    """The largest R from 2 to `most` for which T_sync / T_comp < R - 1, where t_sync_of(R) gives
    T_sync on R ranks; 1 when no R in that range gains."""
    # TODO(exercise 12): the blog's condition, for every R up to `most`.
    raise NotImplementedError("Exercise 12: largest_world is not written yet, see exercises/12_cost.md")


# --- measuring this machine (given) ------------------------------------------------------------


def _seconds(fn, repeat: int = 7, pick=statistics.median) -> float:
    fn()  # the first call also sets things up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return pick(times)


def message_seconds(n: int, pair: dist.ProcessGroup | None = None) -> float:
    """Run on every rank: the time of one message of n bytes between ranks 0 and 1, half a ping-pong's
    round trip. With more ranks, on a group of ranks 0 and 1 (`pair`): messages on the default group
    would put ranks 0 and 1 out of step with the others in the launcher's comparison of collectives."""
    buffer, rank = torch.zeros(n // 4), dist.get_rank()

    def ping_pong():
        if rank == 0:
            dist.send(buffer, 1, group=pair)
            dist.recv(buffer, 1, group=pair)
        elif rank == 1:
            dist.recv(buffer, 0, group=pair)
            dist.send(buffer, 0, group=pair)

    # The fastest of many: what the link costs, without the times another process held the core.
    return _seconds(ping_pong, repeat=30, pick=min) / 2


def measure(config, sizes: list[int]) -> dict:
    """Run on every rank: T_comp of one batch, the time of one message of each of `sizes` bytes, and
    the step time of one all-reduce per parameter after the backward pass."""
    torch.manual_seed(config.seed)
    model = MLP(config)
    x, y = (t[: config.batch_size] for t in gen_dataset(config, rand_state=config.seed))

    def compute():
        model.zero_grad()
        model(x, y)[1].backward()

    def step():
        compute()
        for p in model.parameters():
            dist.all_reduce(p.grad)

    pair = dist.new_group([0, 1])
    return {
        "t_comp": _seconds(compute),
        "sizes": sizes,
        "message": [message_seconds(n, pair) for n in sizes],
        "grad_bytes": [p.numel() * 4 for p in model.parameters()],
        "step": _seconds(step),
    }


def predict(measured: dict, world_size: int) -> dict:
    """Fit the model to the measured messages and predict the step of one all-reduce per parameter."""
    alpha, beta = fit_alpha_beta(measured["sizes"], measured["message"])

    def sync_of(ranks):  # one ring all-reduce per parameter, one after the other
        return sum(ring_allreduce_seconds(n, ranks, alpha, beta) for n in measured["grad_bytes"])

    return {
        "alpha_s": alpha,
        "beta_bytes_per_s": beta,
        "predicted_step_s": measured["t_comp"] + sync_of(world_size),
        "measured_step_s": measured["step"],
        "speedup": {w: speedup(measured["t_comp"], sync_of(w), w) for w in (1, 2, 4)},
        "largest_world": largest_world(measured["t_comp"], sync_of),
    }


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.set_defaults(world_size=2)
    args = parser.parse_args()
    if args.world_size < 2:
        parser.error("the messages go between ranks 0 and 1: --world-size 2 or more")
    sizes = [2**k for k in range(10, 21, 2)]  # 1 KiB to 1 MiB
    # Messages are measured between ranks 0 and 1; the step on every rank; the model predicts other world sizes.
    measured = launch(measure, args.world_size, config_from(args), sizes, **launch_options(args))[0]
    # In a worker too, so that the script's time limit holds there: the prediction runs your functions.
    figures = launch(predict, 1, measured, args.world_size, **launch_options(args))[0]
    print(f"alpha {figures['alpha_s'] * 1e6:.0f} us, beta {figures['beta_bytes_per_s'] / 1e9:.2f} GB/s")
    print(
        f"one step on {args.world_size} ranks, one all-reduce per parameter:"
        f" predicted {figures['predicted_step_s'] * 1e3:.2f} ms,"
        f" measured {figures['measured_step_s'] * 1e3:.2f} ms"
    )
    print("speed-up over one rank:", ", ".join(f"W={w}: {s:.2f}x" for w, s in figures["speedup"].items()))
    print(f"largest world that gains (T_sync / T_comp < R - 1): {figures['largest_world']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"measured": measured, "predicted": figures}, f, indent=1)

# ruff: noqa: F401, F821, F841, B007 - what a stub leaves unused or undefined until it is written
