"""``launch``: run a function on every rank of a world, for scripts. Prints what went wrong.

The work is split by job: course/runtime/workers.py starts and supervises worker processes (``run``),
course/runtime/failure.py diagnoses a world that failed, course/flags.py holds the command-line flags,
course/runtime/cluster.py joins the world of a cluster launcher (torchrun, srun, mpiexec).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from course.device import select as select_device
from course.flags import SCRIPT_TIME_LIMIT, add_launch_arguments, launch_options
from course.runtime import env
from course.runtime.cluster import choose, run_in_external_world
from course.runtime.failure import Failure, RankFact
from course.runtime.workers import Interrupted, Observed, WorldFailed, run

__all__ = [
    "run",
    "launch",
    "bench",
    "WorldFailed",
    "Observed",
    "Failure",
    "RankFact",
    "add_launch_arguments",
    "launch_options",
]


def launch(
    fn: Callable,
    world_size: int,
    *args: Any,
    single_process: bool = False,
    port: int | None = None,
    master_addr: str | None = None,
    backend: str | None = None,
    device: str | None = None,
    time_limit: float | None = None,
    check_collectives: bool = True,
    **kwargs: Any,
) -> list:
    """``run`` for scripts: print the diagnosis and exit non-zero instead of raising.

    ``device`` and ``backend`` (--device, --backend) default to a GPU of its own for every rank
    and nccl where this machine has enough GPUs, else the CPU and gloo. With ``single_process``,
    a world of one runs ``fn`` here without a process group. ``time_limit`` (--time-limit)
    defaults to COURSE_TIMEOUT, else SCRIPT_TIME_LIMIT; collectives are compared on every call
    unless ``check_collectives`` is False (--no-check-collectives).

    Under torchrun, srun or mpiexec this process is already one rank of a world: it joins that
    world and runs ``fn`` here, whatever ``world_size`` and ``single_process`` say (the
    launcher's world size wins; rank 0 notes a difference). Only rank 0 returns, with ``[its
    result]``; the other ranks exit here, so what the script does with the results happens once.
    """
    outside = env.external_world()
    try:
        if outside is not None:
            return run_in_external_world(fn, args, outside, world_size, master_addr, port, backend, device)
        # Asked for the highest local rank: when it has a GPU of its own, every rank has.
        where, backend = choose(device, backend, world_size - 1, world_size, speak=True, same_gpus=True)
        if single_process and world_size == 1:
            select_device(where)
            return [fn(*args)]
        if time_limit is None:
            time_limit = float(os.environ.get("COURSE_TIMEOUT", SCRIPT_TIME_LIMIT))
        return run(
            fn,
            world_size,
            *args,
            port=port,
            backend=backend,
            device=where.partition(":")[0],
            timeout=time_limit,
            debug=check_collectives,
            **kwargs,
        )
    except (NotImplementedError, WorldFailed) as failed:
        _exit_with(failed, longer="--time-limit SECONDS")  # a script's flag (course/flags.py)
    except KeyboardInterrupt as interrupt:
        if isinstance(interrupt, Interrupted):
            print("\n" + interrupt.failure.report(), file=sys.stderr)
        elif outside is None:  # a cluster launcher stops its own ranks and says so
            print(f"\nInterrupted: stopped all {world_size} workers.", file=sys.stderr)
        # The workers are gone (run's finally). Skip the interpreter's teardown: after Ctrl-C
        # the script has nothing left to do, and a full-suite run saw it fail to exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)


def _exit_with(failed: NotImplementedError | WorldFailed, longer: str | None) -> None:
    if isinstance(failed, WorldFailed):
        failed.failure.longer = longer
        print(failed.failure.report(), file=sys.stderr)
    else:  # a TODO not done yet: its message says which and where
        print(failed, file=sys.stderr)
    raise SystemExit(1) from None


def bench(main: Callable, *args: Any) -> Any:
    """Run a benchmark's ``main``: a TODO not written yet, or a world that failed, in the code it
    measures (the student's own files in the students' copy) is said in its report, not raised."""
    try:
        return main(*args)
    except (NotImplementedError, WorldFailed) as failed:
        _exit_with(failed, longer=None)
