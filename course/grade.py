"""Scores for the exercise checks: the table `make grade` prints, and results.json for Gradescope.

A pytest plugin: ``pytest -p course.grade tests/test_ex*_*.py``. Every test in a module named
``test_exN_*.py`` is one check of exercise N, and the checks of an exercise share its POINTS
equally. After the run the plugin prints one table (checks passed, points, and one sentence for
each thing that failed, not a traceback) and writes results.json in the format of Gradescope's
autograders, so the same command is a Gradescope autograder as it stands.

A low grade is not an error: the run exits 0 when only checks failed. It exits non-zero when
the grader itself is broken: a test module that does not import, a fixture that fails, an
exercise missing from POINTS, or a results.json that is not what it wrote.

What a submission cannot change (the README's "Grading" says why, and what it can still do):
the checks run its code only in worker processes and judge here what they send back (see
tests/helpers.py); the grader's own files (tests/, course/, and every module this process has
loaded, torch's included) are fingerprinted before any check runs and compared at the end, and a
change fails every check; results.json is written here, at the end, in one os.replace, and read
back.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass

import pytest

from course.layout import STUDENT_FILES
from course.student import ROOT

# Points of each exercise. A new exercise is one line here and a tests/test_exN_*.py module.
POINTS = {1: 20, 2: 25, 3: 25, 4: 30, 5: 20, 6: 25, 7: 15, 8: 25, 9: 25, 10: 25, 11: 25, 12: 20, 15: 30}

_MODULE = re.compile(r"test_ex(\d+)_\w*\.py")

# The output type that carries a failed check's facts (mistake()) out of a notebook cell that
# autograding runs: course/in_notebook.py shows them, course/autograde.py reads them.
MISTAKE_MIME = "application/vnd.ddp-course.mistake+json"


@dataclass
class Check:
    """One graded check and what became of it."""

    exercise: int
    name: str
    passed: bool
    message: str = ""
    max_score: float = 0.0
    # Code not written yet, as course.failure.Failure.stub says: {"exercise", "func", "handout"}.
    stub: dict | None = None
    # What a failed check diagnosed, as facts that do not depend on its wording (mistake()); the
    # class report (course/report.py) groups the failures of a class by it.
    mistake: dict | None = None
    # How long the check ran (autograding: its notebook cell), when known.
    seconds: float | None = None

    @property
    def score(self) -> float:
        return self.max_score if self.passed else 0.0


def exercise_of(nodeid: str) -> int | None:
    """The exercise a test belongs to, from its module name test_exN_*.py; None for other tests."""
    match = _MODULE.search(nodeid.split("::")[0])
    return int(match.group(1)) if match else None


def share_points(checks: list) -> list:
    """Give each check its share of its exercise's points, in hundredths that add up to them exactly.

    Gradescope shows the sum of the max_score values: the remainder goes to the last check.
    """
    for exercise in {c.exercise for c in checks}:
        if exercise not in POINTS:
            raise KeyError(f"exercise {exercise} has tests but no points: add it to POINTS in course/grade.py")
        mine = [c for c in checks if c.exercise == exercise]
        hundredths = POINTS[exercise] * 100
        for i, check in enumerate(mine):
            share = hundredths // len(mine) + (hundredths % len(mine) if i == len(mine) - 1 else 0)
            check.max_score = share / 100
    return checks


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


_UNIMPORTABLE = re.compile(r"\w+\.py does not import: .*")  # course/impl.py's Unimportable


def _unimportable(message: str) -> str:
    """A student file that does not import: one sentence, whichever rank and world met it."""
    match = _UNIMPORTABLE.match(_first_line(message))
    return match.group(0) if match else ""


# course/impl.py's Unimportable says which file and which error: its sentence is read here, once.
_UNIMPORTABLE_FACTS = re.compile(r"(\w+\.py) does not import: (\w+)")


def explain(error: BaseException) -> str:
    """One sentence saying what a failed check found, from the exception it raised."""
    failure = getattr(error, "failure", None)  # a world of workers that failed (course.workers.WorldFailed)
    if failure is not None:
        first = next((fact for fact in failure.ranks if fact.rank == failure.first), None)
        return (_unimportable(first.message) if first is not None else "") or failure.sentence()
    if isinstance(error, (AssertionError, NotImplementedError, ImportError)) and _first_line(str(error)):
        return _first_line(str(error))
    return f"{type(error).__name__}: {_first_line(str(error))}".rstrip(": ")


def _place(frames: list, keep) -> dict:
    """file, line and func of the innermost of traceback frames that `keep` accepts ({} if none).

    A line of a student's file is left out: it moves with every edit, and students' files differ.
    """
    frame = next((f for f in reversed(frames) if keep(f[0])), None)
    if frame is None:
        return {}
    name = os.path.basename(frame[0])
    return {"file": name, "func": frame[2]} | ({} if name in STUDENT_FILES else {"line": frame[1]})


def _judge(path: str) -> bool:
    """A file of the grader's own checks (tests/) or of the course (course/)."""
    return os.path.abspath(path).startswith(tuple(os.path.join(ROOT, d) + os.sep for d in _OWN_FOLDERS))


def mistake(error: BaseException) -> dict:
    """What a failed check diagnosed, as facts: the same mistake gives the same dict, whatever its sentence.

    - a world of workers that failed: course.failure.Failure's kind, and for the rank that went
      wrong first (every waiting rank, for a hang) the collective and the place (file, func);
      a stub names its function, a file that does not import the file and the error;
    - the check's own assertion: the file, line and function of the `assert` that failed, in
      tests/ (one statement judges one thing);
    - any other exception: its class and where the grader's code met it.
    """
    failure = getattr(error, "failure", None)  # course.workers.WorldFailed
    if failure is not None:
        first = failure.fact(failure.first) if failure.first is not None else None
        broken = _UNIMPORTABLE_FACTS.match(_first_line(first.message)) if first is not None else None
        if broken:
            return {"kind": "unimportable", "file": broken.group(1), "error": broken.group(2)}
        if failure.kind == "stub":
            return {"kind": "stub", "exercise": failure.stub["exercise"], "func": failure.stub["func"]}
        # A hang or a mismatch is the story of every rank; anything else, of the one that went wrong first.
        story = failure.kind in ("mismatch", "p2p_deadlock", "wait", "timeout") or first is None
        ranks = failure.ranks if story else [first]
        return {
            "kind": failure.kind,
            "ranks": [
                {"rank": f.rank, "state": f.state}
                | ({"error": f.error} if f.error and f.state == "raised" else {})
                | ({"collective": f.op or f.collective} if f.op or f.collective else {})
                | ({"file": f.file, "func": f.func} if f.file else {})
                | ({"line": f.line} if f.file and f.file not in STUDENT_FILES else {})
                for f in ranks
            ],
        }
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(error.__traceback__)]
    place = _place(frames, _judge) or _place(frames, lambda path: True)  # a check kept outside tests/
    if isinstance(error, AssertionError):
        return {"kind": "assert"} | place
    return {"kind": "exception", "error": type(error).__name__} | place


def _fmt(points: float) -> str:
    return f"{round(points, 2):g}"


def _row(label, passed: int, total: int, score: float, top: float) -> str:
    return f"{label:>8}  {f'{passed}/{total}':>7}  {f'{_fmt(score)}/{_fmt(top)}':>11}"


def table(checks: list) -> str:
    """Per exercise: checks passed, points, and each distinct failure once with the checks it failed."""
    lines = [f"{'exercise':>8}  {'checks':>7}  {'points':>11}"]
    shown: set = set()
    for exercise in sorted({c.exercise for c in checks}):
        mine = [c for c in checks if c.exercise == exercise]
        lines.append(
            _row(
                exercise,
                sum(c.passed for c in mine),
                len(mine),
                sum(c.score for c in mine),
                sum(c.max_score for c in mine),
            )
        )
        failed = [c for c in mine if not c.passed]
        unwritten = [c.stub for c in failed if c.stub]
        if unwritten:  # an untouched exercise reads as one line, not one per check
            where = ", ".join(dict.fromkeys(f"{stub['func']} (see {stub['handout']})" for stub in unwritten))
            lines.append(
                f"          x {len(unwritten)} check{'s stop' if len(unwritten) > 1 else ' stops'} at code not written yet: {where}"
            )
        failures: dict = {}
        for check in failed:
            if not check.stub:
                failures.setdefault(check.message, []).append(check.name)
        for message, names in failures.items():
            who = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"
            # A file that does not import fails several exercises: its error is printed once.
            said = f"as above ({message.split(':')[0]})" if message in shown else message
            lines.append(f"          x {who}: {said}")
            if _unimportable(message):
                shown.add(message)
    lines.append(
        _row(
            "total",
            sum(c.passed for c in checks),
            len(checks),
            sum(c.score for c in checks),
            sum(c.max_score for c in checks),
        )
    )
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
            | ({"extra_data": {"mistake": c.mistake}} if c.mistake else {})  # what course/report.py groups by
            for c in checks
        ],
    }


def write_results(path: str, checks: list, seconds: float) -> None:
    """Write results.json in one step (a temporary file, then os.replace) and read it back.

    Raises RuntimeError when the file read back is not the one written: another process wrote it.
    """
    results = gradescope(checks, seconds)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(temporary, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(temporary, path)
    with open(path) as f:
        if json.load(f) != results:
            raise RuntimeError(f"{path} changed after the grader wrote it: another process wrote it")


# ---- the grader's own files -----------------------------------------------------------------

_OWN_FOLDERS = ("course", "tests")


def _own_files() -> dict:
    """sha256 of every file of the grader's own folders (not the bytecode Python writes there)."""
    digests = {}
    for folder in _OWN_FOLDERS:
        for top, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                path = os.path.join(top, name)
                with open(path, "rb") as f:
                    digests[os.path.relpath(path, ROOT)] = hashlib.sha256(f.read()).hexdigest()
    return digests


def _loaded_files(attributes=("__file__", "__cached__")) -> dict:
    """Every file this process has loaded code from (sources, bytecode, extensions), with its
    inode, size, and modification and change times: an edit changes the ctime, which no one can set back."""
    stats = {}
    for module in list(sys.modules.values()):
        for path in (getattr(module, name, None) for name in attributes):
            if isinstance(path, str) and path not in stats:
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                stats[path] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return stats


class Fingerprint:
    """The grader's files as they were before any check ran, to compare with at the end."""

    def __init__(self):
        self.started_ns = time.time_ns()
        self.own = _own_files()
        self.loaded = _loaded_files()

    def changes(self) -> list:
        """What changed since, one line each; an empty list when nothing did."""
        own = _own_files()
        changed = sorted(path for path in self.own.keys() | own.keys() if self.own.get(path) != own.get(path))
        loaded = _loaded_files()
        changed += sorted(
            os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path
            for path, stat in self.loaded.items()
            if loaded.get(path) != stat
        )
        # A module first imported after the fingerprint: its source must be older than the
        # fingerprint (its bytecode may be new: Python writes it on first import).
        changed += sorted(
            path
            for path, stat in _loaded_files(("__file__",)).items()
            if path not in self.loaded and stat[3] > self.started_ns
        )
        return list(dict.fromkeys(changed))


# ---- the pytest plugin ----------------------------------------------------------------------


def pytest_addoption(parser):
    parser.addoption("--grade-results", default="results.json", help="where to write Gradescope's results.json")
    parser.addoption(
        "--grade-processes",
        type=int,
        default=1,
        help="grading processes that run checks at once (`python -m course grade`: processes_here())",
    )


def processes_here() -> int:
    """Two grading processes where workers are forked (Linux, one thread per worker: 2 or 3 cores):
    one world of 2 to 4 ranks leaves a third of 2 cores idle, waiting on messages, and two worlds
    at once fill them. One elsewhere: macOS's and Windows' graders cannot fork a copy of themselves
    safely, and with more cores each worker of a world runs several threads."""
    from course import env

    cores = env.usable_cores()
    return min(2, cores) if env.checks_start_method(sys.platform, cores) == "fork" else 1


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # The table says what failed in one sentence per failure: no tracebacks, no pytest summary
    # line ("24 failed") that reads as if the grader had failed.
    config.option.tbstyle = "no"
    config.option.reportchars = ""
    config.option.verbose = min(config.option.verbose, -2)
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
        failure = getattr(call.excinfo.value, "failure", None)
        report.grade_stub = failure.stub if failure is not None and failure.kind == "stub" else None
        report.grade_mistake = mistake(call.excinfo.value)
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

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session):
        # Every check module is imported, and no check has run yet: no submission code has either.
        self.fingerprint = Fingerprint()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session):
        """The checks in `--grade-processes` processes: forked copies of this one, made after the
        fingerprint, run every other check and send back their reports and what of the grader
        changed while they ran; this process runs its share, then logs theirs as its own."""
        processes = min(self.config.getoption("grade_processes"), len(session.items))
        if processes < 2 or session.testsfailed or self.config.option.collectonly:
            return None  # pytest's own loop
        from course import workers

        workers.ready_to_fork()
        children = [_Share(session, session.items[k::processes], self) for k in range(1, processes)]
        try:
            _run(session, session.items[0::processes], log=True)
            for child in children:
                for report in child.reports():
                    self.config.hook.pytest_runtest_logreport(report=report)
                self.changed_elsewhere += child.changed
        finally:
            for child in children:
                child.stop()
        return True

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
                check.message = (
                    check.message or getattr(report, "grade_message", "") or _first_line(report.longreprtext)
                )
                check.stub = check.stub or getattr(report, "grade_stub", None)
                check.mistake = check.mistake or getattr(report, "grade_mistake", None)
            if report.failed and report.when != "call":
                self.broken.append(f"{report.nodeid} ({report.when}): {check.message}")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        self.final = share_points(sorted(self.checks.values(), key=lambda c: (c.exercise, c.name)))
        changed = (self.fingerprint.changes() if self.fingerprint is not None else []) + self.changed_elsewhere
        changed = list(dict.fromkeys(changed))  # each process finds what changed on disk
        if changed:
            more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
            for check in self.final:
                check.passed = False
                check.message = f"the grader's own files changed while it ran ({changed[0]}{more}): no check counts"
        try:
            write_results(self.config.getoption("grade_results"), self.final, time.monotonic() - self.started)
        except (OSError, RuntimeError, ValueError) as error:  # ValueError: what was read back is not JSON
            self.broken.append(f"results.json: {error}")
        if self.broken:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        elif exitstatus == pytest.ExitCode.TESTS_FAILED:
            session.exitstatus = pytest.ExitCode.OK

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.write_line("")
        for line in table(self.final).splitlines():
            terminalreporter.write_line(line)
        for problem in self.broken:
            terminalreporter.write_line(f"GRADER ERROR (not your code): {problem}", red=True)
        terminalreporter.write_line(f"(Gradescope results: {self.config.getoption('grade_results')})")


def _run(session, items: list, log: bool) -> list:
    """Run items as pytest's own loop does; with log=False, return their reports instead of logging them."""
    from _pytest.runner import runtestprotocol

    reports = []
    for i, item in enumerate(items):
        following = items[i + 1] if i + 1 < len(items) else None
        if log:
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=following)
        else:
            reports += runtestprotocol(item, log=False, nextitem=following)
        if session.shouldstop:
            raise session.Interrupted(session.shouldstop)
    return reports


class _Share:
    """A forked copy of the grading process that runs some of the checks.

    It reports to the process it was forked from through a pipe that no worker keeps
    (course/workers.py closes every inherited descriptor in a worker), dies with it, and leaves
    Ctrl-C to it. Reports missing when it ends (it crashed) fail their checks as grader errors.
    """

    def __init__(self, session, items: list, grader: _Grader):
        from course import workers

        self.config, self.items, self.changed = session.config, items, []
        reader, writer = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                os.close(reader)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                workers.die_with_parent()
                reports = [
                    self.config.hook.pytest_report_to_serializable(config=self.config, report=r)
                    for r in _run(session, items, log=False)
                ]
                with os.fdopen(writer, "wb") as pipe:
                    pickle.dump((reports, grader.fingerprint.changes()), pipe)
                code = 0
            except BaseException:  # noqa: BLE001 - said here; the parent fails the checks it did not report
                traceback.print_exc()
            finally:
                workers.stop_kept()
                os._exit(code)
        os.close(writer)
        self.pipe = os.fdopen(reader, "rb")

    def reports(self) -> list:
        """The reports it sent, once it has ended; a failed one for each check it did not report."""
        from _pytest.reports import TestReport

        try:
            sent, self.changed = pickle.load(self.pipe)
        except (EOFError, pickle.UnpicklingError):
            sent = []
        _, status = os.waitpid(self.pid, 0)
        self.pid = None
        reports = [self.config.hook.pytest_report_from_serializable(config=self.config, data=d) for d in sent]
        done = {r.nodeid for r in reports}
        for item in self.items:
            if item.nodeid not in done:
                reason = f"the grading process that ran it ended without its report (status {status})"
                reports.append(TestReport(item.nodeid, item.location, {}, "failed", reason, "setup"))
        return reports

    def stop(self) -> None:
        if self.pid:  # it has not ended: this process was interrupted
            from course import workers

            workers.stop_tree(self.pid)
        self.pipe.close()
