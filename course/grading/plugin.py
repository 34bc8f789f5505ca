"""Scores for the exercise checks: the table `make grade` prints, and results.json for Gradescope.

A pytest plugin: ``pytest -p course.grading.plugin tests/test_ex*_*.py``. Every test of a module named
``test_exN_*.py`` is a check of exercise N, each of its cases worth the whole points of its
``points`` mark (course/grading/points.py: the table the notebooks use too). After the run the plugin
prints one table (checks passed, points, and one sentence for each thing that failed, not a
traceback) and writes results.json in the format of Gradescope's autograders, so the same
command is a Gradescope autograder as it stands.

A low grade is not an error: the run exits 0 when only checks failed. It exits non-zero when
the grader itself is broken: a test module that does not import, a fixture that fails, a check
without points, or a results.json that is not what it wrote; its results.json then says that
the submission could not be graded, never a score.

What a submission cannot change (the README's "What a grade can be trusted for" says why, and
against whom): the checks run its code only in sandboxed worker processes (course/runtime/sandbox.py)
and judge here what they send back (see checks/helpers.py); the grader's own files (tests/,
course/, and every module this process has loaded, torch's included) are fingerprinted before any
check runs and compared at the end, and a change fails every check; results.json says "did not
finish" before any check runs, and is replaced at the end, in one os.replace from a file made
with O_EXCL, and read back.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import pytest

from course.grading.points import concept_of, points_of
from course.layout import ROOT, STUDENT_FILES, graded_exercises

_MODULE = re.compile(r"test_ex(\d+)_\w*\.py")

# The output type that carries what each case of a graded notebook cell found (its points, its
# sentence, mistake()'s facts) out of a cell that autograding runs: course/grading/in_notebook.py shows
# them, course/instructors/autograde.py reads them.
CASES_MIME = "application/vnd.ddp-course.cases+json"


@dataclass
class Check:
    """One graded check and what became of it."""

    exercise: int
    name: str
    passed: bool
    message: str = ""
    max_score: float = 0.0
    # Code not written yet, as course.runtime.failure.Failure.stub says: {"exercise", "func", "handout"}.
    stub: dict | None = None
    # What a failed check diagnosed, as facts that do not depend on its wording (mistake()); the
    # class report (course/instructors/report.py) groups the failures of a class by it.
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
    failure = getattr(error, "failure", None)  # a world of workers that failed (course.runtime.workers.WorldFailed)
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
    """A file of the grader's own checks (tests/) or of the course (course/), but this one: its hooks
    are in every check's traceback."""
    path = os.path.abspath(path)
    return path != os.path.abspath(__file__) and path.startswith(
        tuple(os.path.join(ROOT, d) + os.sep for d in _OWN_FOLDERS)
    )


def mistake(error: BaseException) -> dict:
    """What a failed check diagnosed, as facts: the same mistake gives the same dict, whatever its sentence.

    - a world of workers that failed: course.runtime.failure.Failure's kind, and for the rank that went
      wrong first (every waiting rank, for a hang) the collective and the place (file, func);
      a stub names its function, a file that does not import the file and the error;
    - the check's own assertion: the file, line and function of the `assert` that failed, in
      tests/ (one statement judges one thing);
    - any other exception: its class and where the grader's code met it.
    """
    failure = getattr(error, "failure", None)  # course.runtime.workers.WorldFailed
    if failure is not None:
        first = failure.fact(failure.first) if failure.first is not None else None
        broken = _UNIMPORTABLE_FACTS.match(_first_line(first.message)) if first is not None else None
        if broken:
            return {"kind": "unimportable", "file": broken.group(1), "error": broken.group(2)}
        if failure.kind == "stub":
            return {"kind": "stub", "exercise": failure.stub["exercise"], "func": failure.stub["func"]}
        # A hang or a mismatch is the story of every rank; anything else, of the one that went wrong first.
        story = failure.kind in ("mismatch", "arguments", "p2p_deadlock", "wait", "timeout") or first is None
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
        # The frame of the assert that failed: the innermost judge's, as _place picked it.
        live = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
        frame = next((f for f in reversed(live) if _judge(f.f_code.co_filename)), live[-1] if live else None)
        concept = concept_of(error, frame)
        return {"kind": "assert"} | place | ({"concept": concept} if concept else {})
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


def gradescope(checks: list, seconds: float, note: str = "", advisory: str = "") -> dict:
    """The results in Gradescope's autograder format (results.json); ``note`` ends its output.
    ``advisory``: why the grade cannot be trusted for credit (course/runtime/sandbox.py's Level.advisory),
    kept in its extra_data."""
    return {
        "score": round(sum(c.score for c in checks), 4),
        "execution_time": round(seconds),
        "output": table(checks) + (f"\n{note}" if note else ""),
        "tests": [
            {
                "name": f"Exercise {c.exercise}: {c.name}",
                "score": round(c.score, 4),
                "max_score": round(c.max_score, 4),
                "status": "passed" if c.passed else "failed",
                "output": c.message,
                "visibility": "visible",
            }
            | (
                {"extra_data": {"mistake": c.mistake}} if c.mistake else {}
            )  # what course/instructors/report.py groups by
            for c in checks
        ],
    } | ({"extra_data": {"advisory": advisory}} if advisory else {})


def write_results(path: str, checks: list, seconds: float, note: str = "", advisory: str = "") -> None:
    """Write results.json in one step and read it back (write_json)."""
    write_json(path, gradescope(checks, seconds, note, advisory))


# What results.json says from before the first check until the last: a grader that was stopped
# (killed, out of time) leaves it, and a score of 0 that says why.
UNFINISHED = {
    "score": 0,
    "output": "The grader did not finish: it was stopped before it could write the grade.",
    "tests": [],
}


def classroom(results: dict) -> dict:
    """results.json's grade as a GitHub Classroom grader's result: what its grading reporter reads
    (base64 of this JSON, an output `result` of the step that graded): the same score and checks."""
    tests = [
        {
            "name": test["name"],
            "status": {"passed": "pass", "failed": "fail"}[test["status"]],
            "score": test["score"],
            "message": test["output"],
        }
        for test in results["tests"]
    ]
    graded = all(test["max_score"] > 0 for test in results["tests"]) and tests
    return {
        "version": 1,
        "status": ("pass" if all(t["status"] == "pass" for t in tests) else "fail") if graded else "error",
        "max_score": sum(test["max_score"] for test in results["tests"]),
        "tests": tests
        if graded
        else [{"name": "The grader", "status": "error", "score": 0, "message": results["output"]}],
    }


def give_github_output(results: dict) -> None:
    """Append ``result=`` (base64 of ``classroom(results)``) to the file named by $GITHUB_OUTPUT."""
    import base64

    encoded = base64.b64encode(json.dumps(classroom(results)).encode()).decode()
    with open(os.environ["GITHUB_OUTPUT"], "a") as f:
        f.write(f"result={encoded}\n")


def no_such_exercise(chosen: list | None) -> str:
    """The sentence that refuses the numbers of chosen that are not exercises ("" when all are)."""
    exercises = graded_exercises()
    unknown = [n for n in chosen or [] if n not in exercises]
    if not unknown:
        return ""
    return f"no exercise {', '.join(map(str, unknown))}; exercises are {min(exercises)}–{max(exercises)}"


def not_graded(problems: list) -> dict:
    """results.json of a run that could not grade: it says so, and gives no score as if earned."""
    said = "\n".join(f"GRADER ERROR (not your code): {p}" for p in problems)
    return {
        "score": 0,
        "output": f"This submission could not be graded, so 0 is not its score: ask your instructor.\n{said}",
        "tests": [{"name": "The grader", "status": "failed", "score": 0, "max_score": 0, "output": said}],
    }


def write_json(path: str, data: dict) -> None:
    """Write a JSON file in one step: a new file of a name no one can know beforehand (O_EXCL,
    never a file or link planted there), then os.replace. Read back.

    Raises RuntimeError when the file read back is not the one written: another process wrote it.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    with open(path) as f:
        if json.load(f) != data:
            raise RuntimeError(f"{path} changed after the grader wrote it: another process wrote it")


# ---- the grader's own files -----------------------------------------------------------------

_OWN_FOLDERS = ("course", "checks")


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


def processes_here() -> int:
    """Two grading processes where workers are forked (Linux, one thread per worker: 2 or 3 cores):
    one world of 2 to 4 ranks leaves a third of 2 cores idle, waiting on messages, and two worlds
    at once fill them. One elsewhere: macOS's and Windows' graders cannot fork a copy of themselves
    safely, and with more cores each worker of a world runs several threads."""
    from course.runtime import env

    cores = env.usable_cores()
    return min(2, cores) if env.checks_start_method(sys.platform, cores) == "fork" else 1


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

    def pytest_collectreport(self, report):
        if report.failed:  # a check module that does not import: nothing of it can be graded
            self.broken.append(f"{report.nodeid} could not be collected: {_first_line(report.longreprtext)}")

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
        self.final = sorted(self.checks.values(), key=lambda c: (c.exercise, c.name))
        changed = (self.fingerprint.changes() if self.fingerprint is not None else []) + self.changed_elsewhere
        changed = list(dict.fromkeys(changed))  # each process finds what changed on disk
        if changed:
            more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
            for check in self.final:
                check.passed = False
                check.message = f"the grader's own files changed while it ran ({changed[0]}{more}): no check counts"
        path = self.config.getoption("grade_results")
        self.interrupted = exitstatus == pytest.ExitCode.INTERRUPTED
        results = None
        try:
            if self.interrupted:  # Ctrl-C: the checks that ran are no grade
                write_json(path, not_graded(["grading was interrupted (Ctrl-C) before its checks had all run"]))
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
            terminalreporter.write_line("Interrupted: no grade (results.json says so).")
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
    (course/runtime/workers.py closes every inherited descriptor in a worker), as JSON: nothing read from
    it can run code here. It dies with that process, and leaves Ctrl-C to it. Reports missing when
    it ends (it crashed, or ran past its time) fail their checks as grader errors.
    """

    def __init__(self, session, items: list, grader: _Grader):
        from course.runtime import sandbox, workers

        self.config, self.items, self.changed = session.config, items, []
        reader, writer = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                os.close(reader)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                workers.die_with_parent()
                sandbox.protect()
                reports = [
                    self.config.hook.pytest_report_to_serializable(config=self.config, report=r)
                    for r in _run(session, items, log=False)
                ]
                with os.fdopen(writer, "w") as pipe:
                    json.dump({"reports": reports, "changed": grader.fingerprint.changes()}, pipe)
                code = 0
            except BaseException:  # noqa: BLE001 - said here; the parent fails the checks it did not report
                traceback.print_exc()
            finally:
                workers.stop_kept()
                os._exit(code)
        os.close(writer)
        self.pipe = reader

    def _read(self) -> bytes:
        """What it sent, read until it closes the pipe or its checks' time is up: each check's
        worlds stop at their time limit, so a copy still running after all of them is stuck."""
        limit = time.monotonic() + 60 + len(self.items) * float(os.environ.get("COURSE_TIMEOUT", 600))
        sent = b""
        while time.monotonic() < limit:
            if select.select([self.pipe], [], [], 1.0)[0]:
                chunk = os.read(self.pipe, 1 << 16)
                if not chunk:
                    return sent
                sent += chunk
        raise TimeoutError(f"it was still running after {limit:.0f} s")

    def reports(self) -> list:
        """The reports it sent, once it has ended; a failed one for each check it did not report."""
        from _pytest.reports import TestReport

        from course.runtime import workers

        try:
            found = json.loads(self._read())
            sent, self.changed = found["reports"], found["changed"]
        except (ValueError, KeyError, TypeError, TimeoutError) as error:
            sent, status = [], f"{type(error).__name__}: {error}"
            workers.stop_tree(self.pid)
        else:
            status = f"exit status {os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])}"
        self.pid = None
        reports = [self.config.hook.pytest_report_from_serializable(config=self.config, data=d) for d in sent]
        done = {r.nodeid for r in reports}
        for item in self.items:
            if item.nodeid not in done:
                reason = f"the grading process that ran it ended without its report ({status})"
                reports.append(TestReport(item.nodeid, item.location, {}, "failed", reason, "setup"))
        return reports

    def stop(self) -> None:
        if self.pid:  # it has not ended: this process was interrupted
            from course.runtime import workers

            workers.stop_tree(self.pid)
        os.close(self.pipe)
