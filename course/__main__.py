"""`python -m course COMMAND`: the course's commands, for those who have no `make` (Windows).

    python3 -m course setup [--notebooks | --instructors]   what `make setup` does
    .venv/bin/python -m course grade [--ex N]               what `make grade [EX=N]` does

Python 3.6 must reach setup's version check: this file keeps to 3.6's syntax (tests/test_setup.py).
"""

import argparse
import glob
import os
import sys

from course import setup


def grade(args) -> int:
    """Grade the student files (COURSE_IMPL, default the top-level ones) in this process.

    No plugins but the grader's: pytest-xdist's processes each import torch and the checks anew,
    which costs more than the few checks of one exercise take; the grader forks a copy of itself
    instead where it can (course.grade.processes_here; README, Benchmarks).
    """
    import gc

    # Importing torch, torch._dynamo and the checks takes a fifth longer with the cyclic garbage
    # collector running, and they make no garbage to collect: course/workers.py turns it back on
    # before the first world starts.
    gc.disable()
    from course import grade as plugin
    from course.grade import POINTS
    from course.layout import ROOT

    if args.ex is not None and args.ex not in POINTS:
        print(f"no exercise {args.ex}; exercises are {min(POINTS)}–{max(POINTS)}", file=sys.stderr)
        return 2
    pattern = f"test_ex{args.ex if args.ex is not None else '*'}_*.py"
    checks = sorted(glob.glob(os.path.join(ROOT, "tests", pattern)))
    os.environ.setdefault("COURSE_IMPL", "student")
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    import pytest

    options = ["-p", "no:cacheprovider", "--rootdir", ROOT, "--grade-processes", str(plugin.processes_here())]
    return int(pytest.main([*options, *args.pytest, *checks], plugins=[plugin]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    commands.required = True  # not an argument of add_subparsers before Python 3.7
    grading = commands.add_parser("grade", help="grade your exercise files (mlp.py, dist.py, ...)")
    grading.add_argument("--ex", type=int, help="only this exercise")
    grading.add_argument("pytest", nargs="*", help="more options for pytest (after --)")
    grading.set_defaults(run=grade)
    making = commands.add_parser("setup", help="make .venv with what the exercises need")
    setup.add_arguments(making)
    making.set_defaults(run=setup.main)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
