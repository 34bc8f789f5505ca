"""How long `make grade` takes, from command to verdict: `make bench-grade`.

Runs `python -m course grade [--ex N]` (what `make grade` runs) on the reference solutions, for
every exercise and for all of them, REPEAT times each (default 3), with the start method this
platform gets and with forkserver (what macOS gets), and prints the median wall time of each
against the targets: 5 s for one exercise, 10 s for all. EX="16" (or "6 7"): those exercises only,
without the run of all of them.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from course.layout import ROOT, SOLUTIONS, graded_exercises

REPEAT = int(os.environ.get("REPEAT", 3))
TARGET_ONE, TARGET_ALL = 5.0, 10.0


def seconds(command, env):
    """Median wall time of REPEAT runs; each must end with full marks."""
    times = []
    with tempfile.TemporaryDirectory() as results:
        for _ in range(REPEAT):
            start = time.perf_counter()
            done = subprocess.run(
                command + ["--results", os.path.join(results, "results.json")],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            times.append(time.perf_counter() - start)
            with open(os.path.join(results, "results.json")) as f:
                found = json.load(f)
            if done.returncode != 0 or any(t["status"] != "passed" for t in found["tests"]):
                sys.exit(f"{' '.join(command)} did not give full marks:\n{done.stdout}{done.stderr}")
    return statistics.median(times)


def main():
    grade = [sys.executable, "-m", "course", "grade"]
    base = dict(os.environ, COURSE_IMPL=SOLUTIONS)
    print(f"median of {REPEAT} runs, wall seconds, reference solutions; load average before: {os.getloadavg()[0]:.1f}")
    print(f"{'what':>22}  {'default':>8}  {'forkserver':>10}  {'target':>6}")
    chosen = [int(n) for n in os.environ.get("EX", "").split()]
    for ex in chosen or [*graded_exercises(), None]:
        command = grade + (["--ex", str(ex)] if ex is not None else [])
        default = seconds(command, base)
        forkserver = seconds(command, dict(base, COURSE_START_METHOD="forkserver"))
        target = TARGET_ONE if ex is not None else TARGET_ALL
        label = f"make grade EX={ex}" if ex is not None else "make grade"
        over = [name for name, t in (("default", default), ("forkserver", forkserver)) if t > target]
        flag = f"  over: {', '.join(over)}" if over else ""
        print(f"{label:>22}  {default:8.2f}  {forkserver:10.2f}  {target:6.0f}{flag}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
