"""The command-line flags every script shares: where the ranks run, and how long a run may take."""

from __future__ import annotations

import argparse

from course.runtime import env

# A script's world is stopped, and each rank's line shown, after this long: a hang is explained
# within about a minute. Training runs that need longer pass --time-limit.
SCRIPT_TIME_LIMIT = 60.0


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose error is one line on stderr with argparse's exit status 2: the usage of
    twenty flags printed first would bury it (-h still shows the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def whole(least: int):
    """An argparse type: a whole number of at least `least` (a count of ranks, rows, steps)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least {least}")
        return value

    return parse


def check_batch_fits(parser, batch_size: int, rows: int) -> None:
    """Refuse batches larger than the training rows they are drawn from (mlp.batches yields whole batches
    only, and would look for one for ever)."""
    if batch_size > rows:
        parser.error(
            f"--batch-size {batch_size} is more than the {rows} training rows: lower it, or raise --train-size"
        )


def add_launch_arguments(parser) -> None:
    """The command-line flags of ``launch``: where the ranks meet, what they compute on, limits."""
    group = parser.add_argument_group("where the ranks run (see docs/clusters.md)")
    group.add_argument(
        "--port",
        type=int,
        default=None,
        help="TCP port where the ranks meet (default: a private file for a local world;"
        f" MASTER_PORT or {env.DEFAULT_PORT} under srun or mpiexec)",
    )
    group.add_argument(
        "--master-addr",
        default=None,
        help="host of rank 0 under srun or mpiexec (default: MASTER_ADDR, else srun's first node,"
        " else 127.0.0.1 when all ranks are on this machine)",
    )
    group.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="default: nccl when every rank has a GPU of its own, else gloo",
    )
    group.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (default: GPU r for local rank r when there are enough GPUs, else cpu)",
    )
    group.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"stop the world and show where each rank was after this long (default: COURSE_TIMEOUT,"
        f" else {SCRIPT_TIME_LIMIT:g} s)",
    )
    group.add_argument(
        "--no-check-collectives",
        dest="check_collectives",
        action="store_false",
        help="do not compare the ranks' collectives before each one starts:"
        " a mismatch is then reported only at the collective timeout",
    )


def launch_options(args) -> dict:
    """The keyword arguments of ``launch`` from flags parsed with add_launch_arguments."""
    return dict(
        port=args.port,
        master_addr=args.master_addr,
        backend=args.backend,
        device=args.device,
        time_limit=getattr(args, "time_limit", None),
        check_collectives=getattr(args, "check_collectives", True),
    )
