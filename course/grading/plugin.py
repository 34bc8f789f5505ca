"""The pytest plugin that grades: ``pytest -p course.grading.plugin checks/test_ex*_*.py``.

Every test of a module named ``test_exNN_*.py`` is a check of exercise NN, each of its cases worth
the whole points of its ``points`` mark (course/grading/points.py: the table the notebooks use too).
After the run the plugin prints one table (checks passed, points, and one sentence for each thing
that failed, not a traceback) and writes results.json in the format of Gradescope's autograders
(course/grading/results.py), so the same command is a Gradescope autograder as it stands.

A low grade is not an error: the run exits 0 when only checks failed. It exits non-zero when
the grader itself is broken: a test module that does not import, a fixture that fails, a check
without points, or a results.json that is not what it wrote; its results.json then says that
the submission could not be graded, never a score.

What a submission cannot change (the README's "What a grade can be trusted for" says why, and
against whom): the checks run its code only in sandboxed worker processes (course/runtime/sandbox.py)
and judge here what they send back (see checks/helpers.py); the grader's own files are fingerprinted
before any check runs and compared at the end (course/grading/fingerprint.py), and a change fails
every check; results.json says "did not finish" before any check runs, and is replaced at the end,
in one os.replace from a file made with O_EXCL, and read back.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from course.grading.explain import explain, first_line, mistake
from course.grading.fingerprint import Fingerprint
from course.grading.points import points_of
from course.grading.results import (
    INTERRUPTED,
    UNFINISHED,
    Check,
    give_github_output,
    gradescope,
    interrupted,
    not_graded,
    table,
    write_json,
)
from course.grading.share import Share, run_items

_MODULE = re.compile(r"test_ex(\d+)_\w*\.py")


def exercise_of(nodeid: str) -> int | None:
    """The exercise a test belongs to, from its module name test_exNN_*.py; None for other tests."""
    match = _MODULE.search(nodeid.split("::")[0])
    return int(match.group(1)) if match else None


def pytest_addoption(parser):
    parser.addoption("--grade-results", default="results.json", help="where to write Gradescope's results.json")
    parser.addoption(
        "--grade-fail-under",
        type=float,
        default=None,
        metavar="PERCENT",
        help="exit status 1 when the score is below PERCENT of the points (for autograders that read it)",
    )
    parser.addoption(
        "--grade-github-output",
        action="store_true",
        help="also give the result to GitHub Classroom's grading reporter (`result` in $GITHUB_OUTPUT)",
    )
    parser.addoption(
        "--grade-processes",
        type=int,
        default=1,
        help="grading processes that run checks at once (`python -m course grade`: processes_here())",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # The table says what failed in one sentence per failure: no tracebacks, no pytest summary
    # line ("24 failed") that reads as if the grader had failed.
    config.option.tbstyle = "no"
    config.option.reportchars = ""
    config.option.verbose = min(config.option.verbose, -2)
    from course.runtime import workers

    workers.sandbox_every_world()
    if not hasattr(config, "workerinput"):  # under pytest-xdist the controller keeps the score
        from course.runtime import sandbox

        sandbox.protect()
        write_json(config.getoption("grade_results"), UNFINISHED)  # before any submission code runs
        config.pluginmanager.register(_Grader(config), "course-grader")


def pytest_collection_modifyitems(config, items):
    """Checks of the code the course gives (marked scaffold) earn no points: they are not run."""
    scaffold = [item for item in items if item.get_closest_marker("scaffold")]
    if scaffold:
        items[:] = [item for item in items if item not in scaffold]
        config.hook.pytest_deselected(items=scaffold)


def _points(item) -> int | None:
    """A graded item's points: its case's own mark (pytest.param), else its check's; None for none."""
    case = list(getattr(getattr(item, "callspec", None), "marks", []))  # pytest lists them after the function's
    try:
        return points_of([*case, *item.iter_markers()])
    except ValueError:
        return None


_out_of_time: set = set()  # the exercises of which a world ran out of time, in this grading process


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Once a world of an exercise has run out of time (an endless loop, most likely), the
    exercise's later checks get worlds of env.HANG_WORLD_LIMIT seconds: one endless loop costs
    about a minute, not a minute per check."""
    from course.runtime import env

    usual = os.environ.get("COURSE_TIMEOUT")
    if exercise_of(item.nodeid) in _out_of_time:
        os.environ["COURSE_TIMEOUT"] = env.world_limit_after_a_hang(usual)
    try:
        return (yield)
    finally:
        os.environ.pop("COURSE_TIMEOUT", None)
        os.environ.update({} if usual is None else {"COURSE_TIMEOUT": usual})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    # Only the process that ran the test has the item and the exception: the points and the
    # sentence travel with the report (to the grader from its copy, or from pytest-xdist's workers).
    report.grade_points = _points(item)
    if report.failed and call.excinfo is not None:
        report.grade_message = explain(call.excinfo.value)
        failure = getattr(call.excinfo.value, "failure", None)
        report.grade_stub = failure.stub if failure is not None and failure.kind == "stub" else None
        report.grade_mistake = mistake(call.excinfo.value)
        if report.grade_mistake.get("kind") == "timeout":
            _out_of_time.add(exercise_of(item.nodeid))
    return report


class _Grader:
    def __init__(self, config):
        self.config = config
        self.started = time.monotonic()
        self.checks: dict = {}
        self.broken: list = []
        self.final: list = []
        self.fingerprint: Fingerprint | None = None
        self.changed_elsewhere: list = []  # what the other grading processes found changed
        self.sandbox = ""  # the line that says how submission code ran (course/runtime/sandbox.py)
        self.advisory = ""  # why its grade is advisory, if it is
        self.interrupted = False
        self.below = False  # the score is under --fail-under

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session):
        # Every check module is imported, and no check has run yet: no submission code has either.
        from course.runtime import sandbox, workers

        try:
            level = workers.sandbox_level()
            self.sandbox, self.advisory = level.line(), level.advisory
        except sandbox.NoSandbox as refused:  # COURSE_SANDBOX=required: no check may run
            self.broken.append(str(refused))
            session.shouldfail = str(refused)
        self.fingerprint = Fingerprint()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session):
        """The checks in `--grade-processes` processes: forked copies of this one, made after the
        fingerprint, run every other check and send back their reports and what of the grader
        changed while they ran; this process runs its share, then logs theirs as its own."""
        processes = min(self.config.getoption("grade_processes"), len(session.items))
        if processes < 2 or session.testsfailed or self.config.option.collectonly:
            return None  # pytest's own loop
        from course.runtime import workers
        from course.runtime.processes import ctrl_c_held

        workers.ready_to_fork()
        children = []
        try:
            with ctrl_c_held():  # a copy forked is one stopped below
                children += [Share(session, session.items[k::processes], self.fingerprint) for k in range(1, processes)]
            run_items(session, session.items[0::processes], log=True)
            for child in children:
                for report in child.reports():
                    self.config.hook.pytest_runtest_logreport(report=report)
                self.changed_elsewhere += child.changed
        finally:
            for child in children:
                child.stop()
        return True

    def pytest_keyboard_interrupt(self, excinfo):
        # Ctrl-C; not pytest's own stop (a module of checks that does not import, --maxfail), which
        # raises its Session.Interrupted, a KeyboardInterrupt too, nor pytest.exit().
        stop = excinfo.value
        self.interrupted = isinstance(stop, KeyboardInterrupt) and not isinstance(stop, pytest.Session.Interrupted)

    def pytest_collectreport(self, report):
        if report.failed:  # a check module that does not import: nothing of it can be graded
            self.broken.append(f"{report.nodeid} could not be collected: {first_line(report.longreprtext)}")

    def pytest_runtest_logreport(self, report):
        exercise = exercise_of(report.nodeid)
        if exercise is None:
            return
        name = report.nodeid.split("::", 1)[-1]
        points = getattr(report, "grade_points", None)
        if points is None and report.nodeid not in self.checks:  # course/grading/points.py
            self.broken.append(f"{report.nodeid} has no points: mark it @pytest.mark.points(N), N a whole number")
        check = self.checks.setdefault(report.nodeid, Check(exercise, name, passed=False, max_score=points or 0))
        if report.when == "call" and report.passed and not check.message:
            check.passed = True
        elif report.failed or report.skipped:
            check.passed = False
            if report.skipped:
                check.message = check.message or f"skipped: {first_line(str(report.longrepr))}"
            else:
                check.message = check.message or getattr(report, "grade_message", "") or first_line(report.longreprtext)
                check.stub = check.stub or getattr(report, "grade_stub", None)
                check.mistake = check.mistake or getattr(report, "grade_mistake", None)
            if report.failed and report.when != "call":
                self.broken.append(f"{report.nodeid} ({report.when}): {check.message}")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        from course.runtime import workers

        workers.stop_kept()  # the checks are over: a Ctrl-C after the grade finds no world of theirs to stop
        self.final = sorted(self.checks.values(), key=lambda c: (c.exercise, c.name))
        changed = (self.fingerprint.changes() if self.fingerprint is not None else []) + self.changed_elsewhere
        changed = list(dict.fromkeys(changed))  # each process finds what changed on disk
        if changed:
            more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
            for check in self.final:
                check.passed = False
                check.message = f"the grader's own files changed while it ran ({changed[0]}{more}): no check counts"
        path = self.config.getoption("grade_results")
        results = None
        try:
            if self.interrupted:  # Ctrl-C: the checks that ran are no grade
                write_json(path, interrupted())
            elif self.broken:
                write_json(path, not_graded(self.broken))
            else:
                results = gradescope(self.final, time.monotonic() - self.started, self.sandbox, self.advisory)
                write_json(path, results)
        except (OSError, RuntimeError, ValueError) as error:  # ValueError: what was read back is not JSON
            self.broken.append(f"results.json: {error}")
            results = None
        if self.config.getoption("grade_github_output"):
            give_github_output(results if results is not None and not self.broken else not_graded(self.broken))
        under = self.config.getoption("grade_fail_under")
        self.below = under is not None and results is not None and self.short_of(results, under)
        if self.broken or self.below:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        elif exitstatus == pytest.ExitCode.TESTS_FAILED:
            session.exitstatus = pytest.ExitCode.OK

    @staticmethod
    def short_of(results: dict, percent: float) -> bool:
        """Whether the score is below ``percent`` of the points; exact for 100 (all of them)."""
        top = sum(test["max_score"] for test in results["tests"])
        return results["score"] * 100 < percent * top - 1e-9

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.write_line("")
        if self.interrupted:
            terminalreporter.write_line(INTERRUPTED)
            return
        for line in table(self.final).splitlines():
            terminalreporter.write_line(line)
        if self.sandbox:
            terminalreporter.write_line(self.sandbox)
        for problem in self.broken:
            terminalreporter.write_line(f"GRADER ERROR (not your code): {problem}", red=True)
        if self.below:
            under = self.config.getoption("grade_fail_under")
            terminalreporter.write_line(f"Below {under:g}% of the points: exit status 1 (--fail-under).")
        terminalreporter.write_line(f"(Gradescope results: {self.config.getoption('grade_results')})")
