"""What the exercise notebooks call: run your code, and grade it with the checks `make grade` runs.

The notebooks hold no exercise code of their own. Your code stays in the exercise files (mlp.py, dist.py, ...),
and workers find it there: a function defined in a notebook cell cannot be sent to a worker.
COURSE_IMPL picks the files, as for the tests; unset, they are the top-level student files.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import multiprocessing as mp
import os
import sys
import time
from contextlib import contextmanager

from course import impl
from course.layout import ROOT
from course.runtime import env, processes, sandbox, workers

# The settings the test suite uses, applied before torch is imported; and the checks live in checks/.
os.environ.update(env.check_settings())
if ROOT not in sys.path:
    sys.path.append(ROOT)

import torch  # noqa: E402

# A worker's first optimizer imports torch._dynamo (about 1 s, on every rank). Imported once here, in the
# kernel, it is already there in every check process and worker forked from it.
import torch._dynamo  # noqa: E402, F401

from course.grading.explain import explain, mistake  # noqa: E402
from course.grading.results import CASES_MIME  # noqa: E402
from course.launch import run  # noqa: E402


class CheckFailed(Exception):
    """A check found a mistake. Its message is the whole story, so it is shown without a traceback."""

    def _render_traceback_(self):  # IPython shows this instead of the traceback
        return [f"CheckFailed: {self}"]


def folder() -> str:
    """The folder of the code under test."""
    return impl.selected(default="student")


def load():
    """Your modules, read again from the files: one attribute per student file (.mlp, .dist, ...)."""
    impl.forget(folder())
    return impl.load(folder())


def _call(where: str, module: str, function: str, config: dict | None, args: tuple):
    ex = impl.load(where)
    if config is not None:
        args = (ex.mlp.ModelConfig(**config),) + args
    return getattr(getattr(ex, module), function)(*args)


def on_ranks(
    world_size: int, module: str, function: str, *args, config: dict | None = None, deaths: tuple = ()
) -> list:
    """Run module.function(*args) of your files on every rank of a new world; results by rank.

    With config (ModelConfig's fields), the function's first argument is that ModelConfig, built
    on each rank: an object of a class from your file cannot be sent to a worker. deaths: the ranks
    that a course.faults.Kill among the arguments kills (their results are None).
    """
    impl.forget(folder())
    return run(_call, world_size, folder(), module, function, config, args, deaths=deaths)


@contextmanager
def _stderr_to_stdout():
    """Send this process's and its workers' stderr to stdout for a while.

    nbgrader gives no points to a test cell that wrote anything to stderr, and gloo and torch
    write warnings there that say nothing about the student's code. They still show, as output.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fd, saved_stream = os.dup(2), sys.stderr
    os.dup2(1, 2)
    sys.stderr = sys.stdout
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
        sys.stderr = saved_stream


def _send(conn, message) -> None:
    """Kernel and checks process talk in JSON: neither end unpickles what the other sends."""
    conn.send_bytes(json.dumps(message).encode())


def _receive(conn):
    return json.loads(conn.recv_bytes())


def _serve(conn) -> None:
    """The checks' own process: run the checks it is sent, one after another, answering each with
    one sentence ('' for passed) and the mistake's facts. Its worlds of workers are kept from one
    check to the next (course/runtime/workers.py): they start once, not once per check."""
    sandbox.die_with_parent()
    sandbox.protect()
    workers.sandbox_every_world()
    if hasattr(os, "setpgid"):
        # A group of its own: a shutting-down ipykernel signals the children in its group and waits
        # until none is left, reaping none (2.6 s a kernel). This process ends when its pipe closes.
        os.setpgid(0, 0)
    # The kernel's descriptors, forked with it, held open between checks, would stop its shutdown.
    processes.private_descriptors({conn.fileno()})
    processes.drop_streams()
    torch.set_num_threads(1)  # the judges compare small tensors; their workers have threads of their own
    faulthandler.enable()  # a crash shows its Python stack in the cell's output
    usual_limit = os.environ["COURSE_TIMEOUT"]  # a world's, under the checks (env.check_settings)
    while True:
        try:
            asked = _receive(conn)
            processes.take_streams(conn)
        except EOFError:  # the kernel is gone
            break
        where, kwargs = asked["folder"], asked["kwargs"]
        fn = getattr(importlib.import_module(asked["module"]), asked["name"])
        os.environ["COURSE_TIMEOUT"] = (
            env.world_limit_after_a_hang(usual_limit) if asked["after_a_hang"] else usual_limit
        )
        impl.forget(where)  # what this process read before an edit is stale
        try:
            with _stderr_to_stdout():
                fn(where, **kwargs)
            verdict, facts = "", None
        except Exception as error:  # noqa: BLE001 - any failure of the check is the student's to read
            verdict, facts = explain(error) or type(error).__name__, mistake(error)
        processes.drop_streams()
        _send(conn, {"verdict": verdict, "facts": facts})
    workers.stop_kept()


_checker: dict = {}  # "process", "conn": the checks' process of this kernel, while it lives


def _checks_process():
    """The process that runs this kernel's checks, started by the first."""
    process = _checker.get("process")
    if process is None or not process.is_alive():
        # Forked where that is safe for a process of one thread (_serve): the kernel's imports come along.
        ctx = mp.get_context(env.default_start_method(sys.platform, 1, torch.cuda.is_initialized()))
        here, there = ctx.Pipe()
        # Not a daemon: a daemon may not start the workers of a world.
        process = ctx.Process(target=_serve, args=(there,), name="checks")
        process.start()
        there.close()
        _checker.update(process=process, conn=here)
    return process, _checker["conn"]


def _stop_checks_process() -> None:
    """The checks' process ends when its pipe closes: before multiprocessing, at exit, waits for its
    children (a kernel that autograding forked is itself a multiprocessing child, without atexit)."""
    if _checker:
        _checker["conn"].close()
        _checker["process"].join(timeout=10)
        if _checker["process"].is_alive():
            processes.stop_tree(_checker["process"].pid, _checker["process"].join)
        _checker.clear()


def _show_cases(cases: list) -> None:
    """Give autograding what each case of a graded cell found, as data: an output of its own type.

    Only a kernel that autograding started (course/instructors/autograde.py sets COURSE_MISTAKE_FACTS) shows
    them: a student's notebook would show an output its frontend cannot render.
    """
    if os.environ.get("COURSE_MISTAKE_FACTS") != "1":
        return
    from IPython import get_ipython
    from IPython.display import display

    if get_ipython() is not None:
        display({CASES_MIME: {"cases": cases}}, raw=True)


_INTERRUPT_LATENCY = 0.1  # seconds: how long after Jupyter's interrupt a check stops, at most


def _ask(fn, kwargs: dict, after_a_hang: bool = False) -> tuple:
    """Run fn(folder, **kwargs) in the checks' process: (its sentence, '' for passed; its mistake's facts)."""
    sys.stdout.flush()
    process, conn = _checks_process()
    try:
        asked = {"module": fn.__module__, "name": fn.__qualname__, "folder": folder(), "kwargs": kwargs}
        _send(conn, asked | {"after_a_hang": after_a_hang})
        processes.send_streams(conn, process.pid)
        # In short waits: Python acts on a signal between two of them, whichever of the kernel's
        # threads received it, whereas a read blocked in the main thread ends only with the check.
        while not conn.poll(_INTERRUPT_LATENCY):
            pass
        answer = _receive(conn)
        return answer["verdict"], answer["facts"]
    except (EOFError, OSError, ValueError, KeyError, TypeError):  # it died (or broke) before it could say
        process.join()
        _checker.clear()
        verdict = f"the check's process died with exit code {process.exitcode}: a crash in the code it ran"
        return verdict, {"kind": "check_died", "exit_code": process.exitcode}
    except BaseException:  # Ctrl-C (the kernel interrupted): the check and its workers stop
        _checker.clear()
        processes.stop_tree(process.pid, process.join)
        raise


def check(fn, **kwargs) -> None:
    """Run fn(folder, **kwargs), a check function of checks/, on your files in the checks' process;
    raise CheckFailed saying what is wrong.

    The check runs in a process of its own, started by the first check and kept for the next:
    your code, which the check loads, never runs in the notebook's kernel. A kernel that grades
    holds nothing of the code it grades, and a crash of your code ends a process of the check's,
    not the kernel. Interrupting the kernel stops the check and every process it started.
    """
    verdict, _ = _ask(fn, kwargs)
    if verdict:
        raise CheckFailed(verdict)
    print(f"{fn.__name__}: passed")


_out_of_time: set = set()  # the exercises of which a world ran out of time in this kernel


def grade(test) -> int:
    """Run every case of one check of `make grade` (test, a function of checks/test_exNN_*.py) on
    your files, as `make grade` does; print what each found; return the points they earn, the
    cell's value, which nbgrader records (the points of each case: course/grading/points.py).

    Once a world of an exercise has run out of time, the exercise's later checks get worlds of
    env.HANG_WORLD_LIMIT seconds: one endless loop costs about a minute, not a minute per check.
    """
    from course.grading import points as checks

    earned, found = 0, []
    for case in checks.cases(test):
        started = time.monotonic()
        verdict, facts = _ask(test, case.params, case.exercise in _out_of_time)
        if facts and facts.get("kind") == "timeout":
            _out_of_time.add(case.exercise)
        passed = not verdict
        earned += case.points if passed else 0
        print(f"{case.name}: {'passed' if passed else 'FAILED'}, {case.points if passed else 0}/{case.points}")
        if not passed:
            print(f"    {verdict}")
        found.append(
            {"name": case.name, "points": case.points, "passed": passed, "message": verdict, "mistake": facts}
            | {"seconds": round(time.monotonic() - started, 3)}
        )
    _show_cases(found)
    return earned


mp.util.Finalize(None, _stop_checks_process, exitpriority=10)


def submission_modules(where: str) -> list:
    """The modules of folder `where` that this process holds: none, in a kernel that only grades."""
    where = os.path.abspath(where)
    files = {name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())}
    held = [
        name
        for name, file in files.items()
        if isinstance(file, str) and os.path.isabs(file) and file.startswith(where + os.sep)
    ]
    return sorted(held + [f"{folder} (course.impl)" for folder in impl.loaded() if folder == where])
