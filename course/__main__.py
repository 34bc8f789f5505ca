"""`python -m course COMMAND`: the course's commands, for those who have no `make` (Windows).

    python3 -m course setup [--notebooks]                   what `make setup` does
    .venv/bin/python -m course grade [--ex N]               what `make grade [EX=N]` does
    .venv/bin/python -m course grade --fail-under 100       exit status 1 unless every check passed

Python 3.6 must reach setup's version check: this file keeps to 3.6's syntax (tests/runtime/test_setup.py).
"""

import argparse
import os
import signal
import sys

from course import setup


def grade(args) -> int:
    """Grade the student files (COURSE_IMPL, default the top-level ones) in this process.

    No plugins but the grader's: pytest-xdist's processes each import torch and the checks anew,
    which costs more than the few checks of one exercise take; the grader forks a copy of itself
    instead where it can (course.grading.share.processes_here; docs/design.md, "Grading, `make grade`").
    """
    import importlib.util

    missing = [name for name in ("torch", "pytest") if importlib.util.find_spec(name) is None]
    if missing:  # the system's Python, not the course's: say so, as `python mlp.py` does
        print(
            "{} is not installed for {}: activate the course's environment first ({}), or run make grade".format(
                missing[0], sys.executable, setup.activate_command()
            ),
            file=sys.stderr,
        )
        return 2
    from course.grading import results

    try:
        code = _graded(args)
    except KeyboardInterrupt:  # Ctrl-C where pytest's session does not take it: the imports, the grade's end
        results.write_json(args.results, results.interrupted())
        if args.github_classroom:
            results.give_github_output(results.interrupted())
        print(f"\n{results.INTERRUPTED}")
        return 2  # pytest's exit status for an interrupted session, as the plugin's Ctrl-C gives
    # The grade is given, and nothing of it runs: a Ctrl-C now would only cut the interpreter's exit
    # short, with a traceback under the table.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


def _graded(args) -> int:
    """grade()'s work, wherever Ctrl-C stops it."""
    import gc

    from course.runtime.processes import ctrl_c_held

    # Importing torch, torch._dynamo and the checks takes a fifth longer with the cyclic garbage
    # collector running, and they make no garbage to collect: course/runtime/workers.py turns it back on
    # before the first world starts.
    gc.disable()
    # Ctrl-C waits for torch's import: torch's C code imports numpy, and goes on without it whatever the
    # import raised, a KeyboardInterrupt too (a grade went on to its table so).
    with ctrl_c_held():
        import torch  # noqa: F401
    from course.exercises import by_number
    from course.grading import plugin, results, share
    from course.layout import ROOT, graded_elsewhere, graded_exercises

    elsewhere = None if os.environ.get("COURSE_IMPL") else graded_elsewhere(os.getcwd())
    if elsewhere:
        print(elsewhere, file=sys.stderr)

    problem = results.no_such_exercise(args.ex)
    if problem:
        print(problem, file=sys.stderr)
        results.write_json(args.results, results.not_graded([problem]))  # where an autograder reads it
        if args.github_classroom:
            results.give_github_output(results.not_graded([problem]))
        return 2
    chosen = sorted(set(args.ex)) if args.ex else graded_exercises()
    checks = [os.path.join(ROOT, by_number(n).checks) for n in chosen]
    os.environ.setdefault("COURSE_IMPL", "student")
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    import pytest

    # --assert=plain: pytest's rewritten asserts would make a new string of a check's message, and
    # lose the concept a check gives it (course/grading/points.py's said()), as the notebooks keep it.
    options = ["-p", "no:cacheprovider", "--assert=plain", "--rootdir", ROOT, "--grade-results", args.results]
    options += ["--grade-processes", str(share.processes_here())]
    if args.fail_under is not None:
        options += ["--grade-fail-under", str(args.fail_under)]
    if args.github_classroom:
        options += ["--grade-github-output"]
    ended = _SessionEnd()
    code = pytest.main([*options, *args.pytest, *checks], plugins=[plugin, ended])
    if code == pytest.ExitCode.INTERRUPTED and not ended.seen:
        raise KeyboardInterrupt  # before pytest's session began: the plugin's grader never saw it
    return int(code)


class _SessionEnd:
    """Whether pytest's session reached its end, where the plugin's grader says what came of the grade."""

    seen = False

    def pytest_sessionfinish(self):
        self.seen = True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    commands.required = True  # not an argument of add_subparsers before Python 3.7
    grading = commands.add_parser("grade", help="grade your exercise files (mlp.py, dist.py, ...)")
    grading.add_argument("--ex", type=int, action="append", help="only this exercise (again for more: --ex 6 --ex 7)")
    grading.add_argument(
        "--fail-under",
        type=float,
        metavar="PERCENT",
        help="exit status 1 when the score is below PERCENT of the points (100: anything short of full marks)",
    )
    grading.add_argument(
        "--github-classroom",
        action="store_true",
        help="also give the grade to GitHub Classroom's grading reporter (a step output, `result`)",
    )
    grading.add_argument(
        "--results", default="results.json", metavar="PATH", help="where to write results.json (Gradescope's format)"
    )
    grading.add_argument("pytest", nargs="*", help="more options for pytest (after --)")
    grading.set_defaults(run=grade)
    making = commands.add_parser("setup", help="make .venv with what the exercises need")
    setup.add_arguments(making)
    making.set_defaults(run=setup.main)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
