"""Scores for the exercise checks: the table `make grade` prints, and results.json for Gradescope.

A pytest plugin: ``pytest -p course.grade tests/test_ex*_*.py``. Every test in a module named
``test_exN_*.py`` is one check of exercise N, and the checks of an exercise share its POINTS
equally. After the run the plugin prints one table (checks passed, points, and one sentence for
each thing that failed, not a traceback) and writes results.json in the format of Gradescope's
autograders, so the same command is a Gradescope autograder as it stands.

A low grade is not an error: the run exits 0 when only checks failed. It exits non-zero when
the grader itself is broken: a test module that does not import, a fixture that fails, or an
exercise missing from POINTS.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from typing import Optional

import pytest

# Points of each exercise. A new exercise is one line here and a tests/test_exN_*.py module.
POINTS = {1: 20, 2: 25, 3: 25, 4: 30, 5: 20, 6: 25, 7: 15}

_MODULE = re.compile(r"test_ex(\d+)_\w*\.py")
_STUB = re.compile(r"Exercise \d+: (\S+) is not written yet, see (\S+)")  # course/student.py's stubs


@dataclass
class Check:
    """One graded check and what became of it."""

    exercise: int
    name: str
    passed: bool
    message: str = ""
    max_score: float = 0.0

    @property
    def score(self) -> float:
        return self.max_score if self.passed else 0.0


def exercise_of(nodeid: str) -> Optional[int]:
    """The exercise a test belongs to, from its module name test_exN_*.py; None for other tests."""
    match = _MODULE.search(nodeid.split("::")[0])
    return int(match.group(1)) if match else None


def share_points(checks: list) -> list:
    """Give each check its share of its exercise's points."""
    for exercise in {c.exercise for c in checks}:
        if exercise not in POINTS:
            raise KeyError(f"exercise {exercise} has tests but no points: add it to POINTS in course/grade.py")
        mine = [c for c in checks if c.exercise == exercise]
        for check in mine:
            check.max_score = POINTS[exercise] / len(mine)
    return checks


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def explain(error: BaseException) -> str:
    """One sentence saying what a failed check found, from the exception it raised."""
    failure = getattr(error, "failure", None)  # a world of workers that failed (course.launch.WorldFailed)
    if failure is not None:
        return failure.sentence()
    if isinstance(error, (AssertionError, NotImplementedError, ImportError)) and _first_line(str(error)):
        return _first_line(str(error))
    return f"{type(error).__name__}: {_first_line(str(error))}".rstrip(": ")


def _fmt(points: float) -> str:
    return f"{round(points, 2):g}"


def _row(label, passed: int, total: int, score: float, top: float) -> str:
    return f"{label:>8}  {f'{passed}/{total}':>7}  {f'{_fmt(score)}/{_fmt(top)}':>11}"


def table(checks: list) -> str:
    """Per exercise: checks passed, points, and each distinct failure once with the checks it failed."""
    lines = [f"{'exercise':>8}  {'checks':>7}  {'points':>11}"]
    for exercise in sorted({c.exercise for c in checks}):
        mine = [c for c in checks if c.exercise == exercise]
        lines.append(_row(exercise, sum(c.passed for c in mine), len(mine), sum(c.score for c in mine), sum(c.max_score for c in mine)))
        failed = [c for c in mine if not c.passed]
        unwritten = [m for c in failed if (m := _STUB.fullmatch(c.message))]
        if unwritten:  # an untouched exercise reads as one line, not one per check
            where = ", ".join(dict.fromkeys(f"{m.group(1)} (see {m.group(2)})" for m in unwritten))
            lines.append(f"          x {len(unwritten)} check{'s stop' if len(unwritten) > 1 else ' stops'} at code not written yet: {where}")
        failures: dict = {}
        for check in failed:
            if not _STUB.fullmatch(check.message):
                failures.setdefault(check.message, []).append(check.name)
        for message, names in failures.items():
            who = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"
            lines.append(f"          x {who}: {message}")
    lines.append(_row("total", sum(c.passed for c in checks), len(checks), sum(c.score for c in checks), sum(c.max_score for c in checks)))
    return "\n".join(lines)


def gradescope(checks: list, seconds: float) -> dict:
    """The results in Gradescope's autograder format (results.json)."""
    return {
        "score": round(sum(c.score for c in checks), 4),
        "execution_time": round(seconds),
        "output": table(checks),
        "tests": [
            {
                "name": f"Exercise {c.exercise}: {c.name}",
                "score": round(c.score, 4),
                "max_score": round(c.max_score, 4),
                "status": "passed" if c.passed else "failed",
                "output": c.message,
                "visibility": "visible",
            }
            for c in checks
        ],
    }


def write_results(path: str, checks: list, seconds: float) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(gradescope(checks, seconds), f, indent=1)


# ---- the pytest plugin ----------------------------------------------------------------------


def pytest_addoption(parser):
    parser.addoption("--grade-results", default="results.json", help="where to write Gradescope's results.json")


def pytest_configure(config):
    # The table says what failed in one sentence per failure: no tracebacks, no second summary.
    config.option.tbstyle = "no"
    config.option.reportchars = ""
    if not hasattr(config, "workerinput"):  # under pytest-xdist the controller keeps the score
        config.pluginmanager.register(_Grader(config), "course-grader")


def pytest_collection_modifyitems(config, items):
    """Checks of the code the course gives (marked scaffold) earn no points: they are not run."""
    scaffold = [item for item in items if item.get_closest_marker("scaffold")]
    if scaffold:
        items[:] = [item for item in items if item not in scaffold]
        config.hook.pytest_deselected(items=scaffold)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    # Only the process that ran the test has the exception; the sentence travels with the report.
    if report.failed and call.excinfo is not None:
        report.grade_message = explain(call.excinfo.value)
    return report


class _Grader:
    def __init__(self, config):
        self.config = config
        self.started = time.monotonic()
        self.checks: dict = {}
        self.broken: list = []
        self.final: list = []

    def pytest_runtest_logreport(self, report):
        exercise = exercise_of(report.nodeid)
        if exercise is None:
            return
        name = report.nodeid.split("::", 1)[-1]
        check = self.checks.setdefault(report.nodeid, Check(exercise, name, passed=False))
        if report.when == "call" and report.passed and not check.message:
            check.passed = True
        elif report.failed or report.skipped:
            check.passed = False
            if report.skipped:
                check.message = check.message or f"skipped: {_first_line(str(report.longrepr))}"
            else:
                check.message = check.message or getattr(report, "grade_message", "") or _first_line(report.longreprtext)
            if report.failed and report.when != "call":
                self.broken.append(f"{report.nodeid} ({report.when}): {check.message}")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        self.final = share_points(sorted(self.checks.values(), key=lambda c: (c.exercise, c.name)))
        write_results(self.config.getoption("grade_results"), self.final, time.monotonic() - self.started)
        if exitstatus == pytest.ExitCode.TESTS_FAILED and not self.broken:
            session.exitstatus = pytest.ExitCode.OK

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.write_line("")
        for line in table(self.final).splitlines():
            terminalreporter.write_line(line)
        for problem in self.broken:
            terminalreporter.write_line(f"GRADER ERROR (not your code): {problem}", red=True)
        terminalreporter.write_line(f"(Gradescope results: {self.config.getoption('grade_results')})")
