"""`make compat TORCH=2.11.0`: every exercise's checks and reference script under another torch.

    python -m course.instructors.compat_check --torch 2.11.0     # a side venv of that torch (cached), every exercise's checks
    python -m course.instructors.compat_check --torch 2.11.0 --ex 14 --scripts   # exercise 14's checks and the scripts only
    python -m course.instructors.compat_check --scripts          # the reference scripts in this environment (make demo)

The supported range, and what differs across it, is course/runtime/compat.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from course.exercises import EXERCISES
from course.runtime.compat import NEWEST, OLDEST

# The reference scripts, as `make demo` runs them: each exercise's (course/exercises.py).
SCRIPTS = tuple(script for exercise in EXERCISES for script in exercise.demo)


def venv_for(version: str, cache: str | None = None) -> str:
    """The Python of a side venv with torch==version (and what grading needs), made on first use and
    kept under ~/.cache/ddp-course/compat-VERSION: from PyPI, torch is a CUDA build of several GB."""
    cache = cache or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ddp-course")
    folder = os.path.join(cache, f"compat-{version}")
    python = os.path.join(folder, "bin", "python")
    if _torch_version(python) == version:
        return python
    shutil.rmtree(folder, ignore_errors=True)  # a half-made venv from an install that was stopped
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", folder], check=True)
    # A pip configuration may cap torch (a machine's constraints file); the version asked for wins.
    env = dict(os.environ, PIP_CONSTRAINT=os.devnull)
    install = [python, "-m", "pip", "install", "-q", f"torch=={version}", "numpy", "pytest", "pytest-xdist"]
    subprocess.run(install, check=True, env=env)
    print(f"compat: made {folder} in {time.monotonic() - started:.0f} s")
    return python


def _torch_version(python: str) -> str | None:
    if not os.path.exists(python):
        return None
    asked = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return asked.stdout.strip().split("+")[0] if asked.returncode == 0 else None


def grade(python: str, exercises: list, implementation: str) -> tuple:
    """({exercise: (score, most)}, seconds) of one `python -m course grade` of `exercises` on the reference
    ("solutions") or the stubs ("student"): one grader for all, as a student's `make grade` runs them."""
    from course.layout import ROOT

    with tempfile.TemporaryDirectory() as folder:
        results = os.path.join(folder, "results.json")
        started = time.monotonic()
        subprocess.run(
            [python, "-m", "course", "grade", *(f"--ex={n}" for n in exercises), "--results", results],
            cwd=ROOT,
            env=dict(os.environ, COURSE_IMPL=implementation),
            capture_output=True,
        )
        seconds = time.monotonic() - started
        try:
            with open(results) as file:
                graded = json.load(file)["tests"]
        except (OSError, ValueError, KeyError):  # the grader did not start (torch does not import, say)
            graded = []
    scores = {n: (0.0, 0.0) for n in exercises}
    for test in graded:
        # Gradescope's names say which exercise each check is of: "Exercise 5: test_ring[2]".
        n = int(test["name"].split(":")[0].split()[-1])
        score, most = scores.get(n, (0.0, 0.0))
        scores[n] = (score + test["score"], most + test["max_score"])
    return scores, seconds


def run_scripts(python: str, quiet: bool) -> list:
    """Run every reference script; (command, exit status, seconds, its output when quiet) each."""
    from course.layout import ROOT, SOLUTIONS

    ran = []
    for script in SCRIPTS:
        name, *flags = script.split()
        started = time.monotonic()
        # The course's own venv has the course installed; a side venv finds it on PYTHONPATH.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        command = [python, os.path.join(SOLUTIONS, name), *flags]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=quiet, text=True)
        ran.append((script, done.returncode, time.monotonic() - started, (done.stdout or "") + (done.stderr or "")))
        if done.returncode and not quiet:
            break
    return ran


def check(python: str, exercises: list | None = None, scripts: bool = True) -> bool:
    """Every exercise's checks (or those of `exercises`) on the reference (full marks) and on the stubs
    (0), then the reference scripts, under `python`; one line each. True when all are as they should be."""
    from course.layout import graded_exercises

    version = _torch_version(python)
    print(f"compat: torch {version}, {python}")
    good = True
    exercises = graded_exercises() if exercises is None else exercises
    if exercises:
        reference, seconds = grade(python, exercises, "solutions")
        stubs, stub_seconds = grade(python, exercises, "student")
        print(f"compat: graded the reference in {seconds:.0f} s, the stubs in {stub_seconds:.0f} s")
    for exercise in exercises:
        (score, most), (stub_score, _) = reference[exercise], stubs[exercise]
        ok = score == most > 0 and stub_score == 0
        good &= ok
        print(f"exercise {exercise:>2}: {'pass' if ok else 'FAIL'}  reference {score:g}/{most:g}, stubs {stub_score:g}")
    for script, status, seconds, output in run_scripts(python, quiet=True) if scripts else []:
        good &= status == 0
        print(f"solutions/{script}: {'pass' if status == 0 else f'FAIL (exit {status})'} ({seconds:.0f} s)", flush=True)
        if status:
            print("\n".join("    " + line for line in output.strip().splitlines()[-15:]))
    print(f"compat: torch {version}: {'every exercise as it should be' if good else 'see the lines marked FAIL'}")
    return good


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course.instructors.compat_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--torch", metavar="VERSION", help=f"the torch to check, {OLDEST} to {NEWEST} (or oldest, newest)"
    )
    parser.add_argument("--scripts", action="store_true", help="only the reference scripts (alone: here, make demo)")
    parser.add_argument("--ex", type=int, action="append", help="only this exercise's checks (again for more)")
    args = parser.parse_args(argv)
    if args.scripts and not args.torch:
        return int(any(status for _, status, _, _ in run_scripts(sys.executable, quiet=False)))
    version = {"oldest": OLDEST, "newest": NEWEST}.get(args.torch, args.torch)
    python = venv_for(version) if version else sys.executable
    exercises = [] if args.scripts and not args.ex else args.ex
    return 0 if check(python, exercises, scripts=args.scripts or not args.ex) else 1


if __name__ == "__main__":
    sys.exit(main())
