"""Instructors only: `make autograde` end to end, on sample submissions made from the reference.

Two runs grade seven students through nbgrader (the expensive part of the suite, so it runs once,
in one test). The first grades the reference on every exercise that has a notebook:
- perfect: the reference, whose code also writes to stderr in the workers, as gloo and torch
  warnings do: nbgrader would zero a test cell with stderr output.
The second grades the mistakes of the course's brief, one submission that crashes, and two more
with a mistake already made, for the class report, on the exercises where they lose points
(`--ex`, as an instructor grades this week's exercises):
- mistakes: exercise 4 sums gradients instead of averaging them, and exercise 2's ranks wait for
  a broadcast rank 0 never sends. It also tries to cheat: a conftest.py, its own tests/ and
  course/ that would pass everything, and a notebook whose test cell is emptied and whose extra
  cell replaces `check`;
- syntax: mlp.py does not parse (the other files but dist.py import it: only exercises 2 and 5 pass);
- crash: MyDP's gradient hook segfaults, in workers (whose world reports it, with the line); the
  kernel that runs the checks runs none of it. The check that runs no backward pass (the start
  broadcast) still passes;
- sums_again, sums_too: the summed gradients of `mistakes`, written in other ways: the class report
  (grading/report.html and report.json, course/instructors/report.py) counts three students in its row.
  sums_too also hands in notebooks that are not: a written answer whose source is not text, and a
  file that is not JSON (the reasons reach its feedback; the class is graded).
- timer: the student files, dist.py's TODOs answered with wrong numbers and a timer that writes into
  the output the kernel reads its probes from (tests/grading/test_cheating.py's TIMER_INTO_THE_OUTPUT): it
  scores 0, exercise 2's checks saying its wrong numbers, and no classmate's feedback holds what it
  wrote.
Two of the class (a hang and assertion failures; a segfault) are graded again by `python -m course
grade`, which must give every check the points nbgrader gave it: one grade, whichever path.
"""

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from checks.helpers import world
from course.exercises import STUDENT_FILES
from course.grading import points as checks
from course.instructors.make_notebooks import exercise_of, sources
from course.layout import ROOT
from tests import warm
from tests.grading.test_cheating import TIMER_INTO_THE_OUTPUT
from tests.grading.test_report import References
from tests.mutants import make_mutant

# What the second run grades: where its students lose points.
CLASS_EXERCISES = [2, 4]
# Points lost in CLASS_EXERCISES, by exercise; every other one of them scores full marks.
LOST = {
    # exercise 2's product by row hangs on 2 ranks or more (one rank receives nothing), and so
    # does its contracts check (2 ranks); in 4, start_sync, frozen and the hook's argument pass, the
    # steps fail
    "mistakes": {2: 3 * 3 + 1, 4: 30 - (8 + 4 + 2)},
    "syntax": {4: 30},  # mydp.py imports mlp.py; dist.py does not
    "crash": {4: 30 - (8 + 1)},  # every check that runs a backward pass through MyDP's hook
    "sums_again": {4: 16},
    "sums_too": {4: 16},
    "timer": {2: 25, 4: 30},
}


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _cheating_notebook(path):
    with open(os.path.join(ROOT, "exercises", "04_mydp.ipynb")) as f:
        nb = json.load(f)
    for cell in nb["cells"]:
        grade_id = cell["metadata"].get("nbgrader", {}).get("grade_id")
        if grade_id == "ex4_mydp_steps":
            cell["source"] = "pass"
        if grade_id == "ex4_how_many_calls":
            cell["source"] = "One all-reduce per parameter."
    nb["cells"].insert(
        2,
        {
            "cell_type": "code",
            "id": "cheat",
            "metadata": {},
            "execution_count": None,
            "outputs": [],
            "source": "check = lambda *args: None",
        },
    )
    _write(path, json.dumps(nb))


def _unreadable_notebooks(folder):
    """Exercise 2's notebook with a written answer whose source is not text; exercise 4's, not JSON."""
    with open(os.path.join(ROOT, "exercises", "02_dist.ipynb")) as f:
        nb = json.load(f)
    for cell in nb["cells"]:
        if cell["metadata"].get("nbgrader", {}).get("solution"):
            cell["source"] = [1, 2, 3]
    _write(os.path.join(folder, "02_dist.ipynb"), json.dumps(nb))
    _write(os.path.join(folder, "04_mydp.ipynb"), "{ not json")


# What take_in says of _unreadable_notebooks, each to the student's feedback.
UNREADABLE = (
    "02_dist.ipynb: the answers ['ex2_what_moves'] are not text: left empty",
    "04_mydp.ipynb could not be read (JSONDecodeError): its written answers are empty",
)


def make_submissions(root):
    """The reference in root/reference/perfect; the students of LOST in root/class/."""
    warn = "import sys; print('UserWarning: a warning, as gloo prints', file=sys.stderr)\n        "
    make_mutant(root / "reference" / "perfect", "mlp.py", "sizes = [config.d_in]", warn + "sizes = [config.d_in]")
    root = root / "class"
    mistakes = make_mutant(root / "mistakes", "mydp.py", "mean = grad / dist.get_world_size()", "mean = grad.clone()")
    with open(os.path.join(mistakes, "dist.py")) as f:
        dist_py = f.read()
    assert dist_py.count("    dist.broadcast(B, src=0)\n") == 1
    _write(
        os.path.join(mistakes, "dist.py"),
        dist_py.replace("    dist.broadcast(B, src=0)\n", "        dist.recv(B, src=0)  # rank 0 never sends\n"),
    )
    _write(
        os.path.join(mistakes, "conftest.py"),
        "import pytest\n\n\ndef pytest_runtest_call(item):\n    pytest.skip('free points')\n",
    )
    _write(os.path.join(mistakes, "checks", "test_ex04_mydp.py"), "def test_everything():\n    pass\n")
    _write(os.path.join(mistakes, "course", "__init__.py"), "")
    _write(os.path.join(mistakes, "course", "notebook.py"), "def check(*args):\n    pass\n")
    _cheating_notebook(os.path.join(mistakes, "exercises", "04_mydp.ipynb"))
    make_mutant(root / "sums_again", "mydp.py", "mean = grad / dist.get_world_size()", "mean = grad * 1.0")
    _unreadable_notebooks(
        make_mutant(root / "sums_too", "mydp.py", "mean = grad / dist.get_world_size()", "mean = grad + 0")
    )
    (root / "timer").mkdir()  # the student's files, dist.py with a cheat
    for name in STUDENT_FILES:
        shutil.copy(os.path.join(ROOT, name), root / "timer")
    with open(root / "timer" / "dist.py", "a") as f:
        f.write("\n" + TIMER_INTO_THE_OUTPUT)
    make_mutant(
        root / "syntax",
        "mlp.py",
        "def split_dataset(X, Y, train_fraction=0.9):",
        "def split_dataset(X, Y, train_fraction=0.9)",
    )
    make_mutant(
        root / "crash",
        "mydp.py",
        "        mean = grad / dist.get_world_size()\n",
        "        import ctypes; ctypes.string_at(0)  # reads address 0\n        mean = grad / dist.get_world_size()\n",
    )


def processes_in(folder):
    """Processes whose working directory is inside folder (kernels and their workers run there)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(folder)):
                found.append(pid)
        except OSError:
            pass
    return found


def autograde(submissions, out, *exercises):
    """`python -m course.instructors.autograde` on a folder of submissions; its completed process. It runs under
    tests/import_audit.py: its own process imports nothing once its first kernel is asked for."""
    # The checks' own limits (course/runtime/env.py's CHECK_SETTINGS): the deadlock is found by the waits boards.
    audit = out.parent / f"{out.name}-imports.txt"
    environ = dict(os.environ, PYTHONPATH=ROOT)
    environ["COURSE_IMPORT_AUDIT"] = str(audit)
    command = [
        sys.executable,
        "-m",
        "tests.import_audit",
        "course.instructors.autograde",
        str(submissions),
        "--out",
        str(out),
    ]
    # autograde's own cell limit (300 s), and a bound on the whole that only a hang reaches: a class takes 40 s,
    # and a loaded machine stretches the checks' worlds (course/runtime/processes.py's OwnTime) and the cells with them.
    done = subprocess.run(
        command + [f"--ex={n}" for n in exercises],
        cwd=out.parent,
        env=environ,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert audit.read_text() == "", f"imported once kernels could run submission code: {audit.read_text()}"
    return done


def check_scores(out, done, student, exercises, lost):
    """nbgrader's CSV and the student's results.json: each exercise's points less what was lost."""
    with open(out / "grades.csv") as f:
        rows = {(row["student_id"], row["assignment"]): row for row in csv.DictReader(f)}
    assert {assignment for (_, assignment) in rows} == {f"ex{n}" for n in exercises}, sorted(rows)
    points = checks.points()
    scores = tuple(points[n] - lost.get(n, 0) for n in exercises)
    got = tuple(float(rows[student, f"ex{n}"]["score"]) for n in exercises)
    where = out / "feedback" / student / "results.json"
    results = json.loads(where.read_text()) if where.exists() else {"tests": []}
    failed = "\n".join(f"{t['name']}: {t['output']}" for t in results["tests"] if t["status"] == "failed")
    assert got == scores, f"{student}: nbgrader's CSV has {got}, expected {scores}\n{done.stdout}\nfailed:\n{failed}"
    by_exercise = tuple(
        sum(t["score"] for t in results["tests"] if t["name"].startswith(f"Exercise {n}:")) for n in exercises
    )
    assert by_exercise == scores and results["score"] == sum(scores), f"{student}: results.json has {by_exercise}"
    assert all(t["status"] == ("passed" if t["score"] == t["max_score"] else "failed") for t in results["tests"])
    assert (out / "feedback" / student / "feedback.txt").exists()
    return rows


def test_autograde_end_to_end(tmp_path):
    make_submissions(tmp_path / "submissions")
    out = tmp_path / "reference"
    done = autograde(tmp_path / "submissions" / "reference", out)
    exercises = sorted(exercise_of(path) for path in sources())
    rows = check_scores(out, done, "perfect", exercises, {})
    assert "a warning, as gloo prints" not in done.stdout + done.stderr, "a student's output reached the terminal"
    assert "a warning, as gloo prints" in (out / "feedback" / "perfect" / "output.txt").read_text(), "and its feedback"
    assert float(rows["perfect", "ex4"]["max_score"]) == 32, (
        "exercise 4's notebook: 30 autograded points and 2 for the written answer"
    )
    page = (out / "feedback" / "perfect" / "feedback.html").read_text()
    assert "<h2" in page and f"Exercise {exercises[-1]}" in page, "a section per exercise"
    grade_written_answers_by_hand(out, "perfect", "ex4")

    out = tmp_path / "class"
    done = autograde(tmp_path / "submissions" / "class", out, *CLASS_EXERCISES)
    for student, lost in LOST.items():
        check_scores(out, done, student, CLASS_EXERCISES, lost)
    same_grade_from_make_grade(tmp_path, out, ["mistakes", "crash"])
    written = {
        step: [p.stat().st_mtime for p in (out / step).glob("*/ex*/*.ipynb")] for step in ("autograded", "submitted")
    }
    assert min(written["autograded"]) < max(written["submitted"]), (
        "nbgrader records a kernel's notebooks while the next kernels run, not all of them at the end"
    )

    def feedback(student, kind="txt"):
        with open(out / "feedback" / student / f"feedback.{kind}") as f:
            return f.read()

    assert "2.0x the expected average" in feedback("mistakes")
    assert "Timed out" in feedback("mistakes") or "waited in a collective" in feedback("mistakes"), feedback("mistakes")
    assert "mlp.py does not import: SyntaxError" in feedback("syntax")
    assert "exit code -11" in feedback("crash") and "mydp.py:" in feedback("crash"), feedback("crash")
    with open(out / "feedback" / "sums_too" / "results.json") as f:
        said = json.load(f)["output"]
    assert all(reason in feedback("sums_too") and reason in said for reason in UNREADABLE), said
    with open(out / "autograded" / "mistakes" / "ex4" / "04_mydp.ipynb") as f:
        graded = json.load(f)["cells"]
    assert "cheat" not in {c["id"] for c in graded}, "a code cell the student added to a notebook was run"
    assert any("".join(c["source"]) == "One all-reduce per parameter." for c in graded), (
        "the student's written answer was not carried over"
    )

    page = feedback("mistakes", "html")  # nbconvert's page: the failed checks' messages and the written answers
    assert (
        "2.0x the expected average" in page and "test_mydp_steps[3]" in page and "One all-reduce per parameter." in page
    )

    def ex2_tests(student):
        with open(out / "feedback" / student / "results.json") as f:
            return [t for t in json.load(f)["tests"] if t["name"].startswith("Exercise 2:")]

    # Each of the timer's checks says its own reason (its stubs keep no dtype: test_contracts says so).
    said = {t["name"]: t["output"] for t in ex2_tests("timer")}
    assert all(("dtype" if "contracts" in name else "returned wrong numbers") in s for name, s in said.items()), said
    assert all(t["status"] == "passed" and not t["output"] for t in ex2_tests("sums_again")), "a correct dist.py"
    for student in set(LOST) - {"timer"}:
        for page in (out / "feedback" / student).iterdir():
            assert "CHEAT" not in page.read_text(), f"the timer's output reached {student}'s {page.name}"

    check_class_report(out, done.stdout)
    assert re.search(r"^\[1/6\] \w+: its checks ran [\d.]+ s; about \d+ s left$", done.stdout, re.M), (
        "one progress line per student as it is graded"
    )

    deadline = time.monotonic() + 30  # an event's bound: a loaded machine may take seconds to end a killed process
    while processes_in(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_in(tmp_path), "autograde left processes behind"


def grade_written_answers_by_hand(out, student, assignment):
    """The written answers, graded as docs/instructors.md says: in formgrader, whose manual grading
    stores each answer's points in gradebook.db (done here through nbgrader's own Gradebook API, as
    formgrader's server does), then `nbgrader export` in the grading folder: the total then holds
    the checks' and the answers' points."""
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{out / 'gradebook.db'}") as gradebook:
        submission = gradebook.find_submission(assignment, student)
        answers = [g for nb in submission.notebooks for g in nb.grades if g.cell.cell_type == "markdown"]
        assert [g.max_score for g in answers] == [2], "exercise 4's one written answer, 2 points"
        for g in answers:
            g.manual_score = g.max_score
        gradebook.db.commit()
    (out / "grades.csv").unlink()
    nbgrader = os.path.join(os.path.dirname(sys.executable), "nbgrader")
    done = subprocess.run([nbgrader, "export"], cwd=out, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(out / "grades.csv") as f:
        row = next(r for r in csv.DictReader(f) if (r["student_id"], r["assignment"]) == (student, assignment))
    assert float(row["score"]) == float(row["max_score"]) == 32, row


def by_check(results: dict, exercise: int) -> dict:
    """A results.json's points of each check of one exercise."""
    return {t["name"]: t["score"] for t in results["tests"] if t["name"].startswith(f"Exercise {exercise}:")}


def same_grade_from_make_grade(tmp_path, out, students):
    """One grade per submission: `python -m course grade` on a student's folder gives each exercise
    the points that nbgrader's gradebook gave it (the written answers aside), check by check."""
    with open(out / "grades.csv") as f:
        rows = {(row["student_id"], row["assignment"]): row for row in csv.DictReader(f)}

    def grade(student):
        folder = tmp_path / f"make-grade-{student}"
        folder.mkdir()
        environ = dict(os.environ, COURSE_IMPL=str(tmp_path / "submissions" / "class" / student))
        ex = [arg for n in CLASS_EXERCISES for arg in ("--ex", str(n))]
        done = warm.run(["-m", "course", "grade", *ex], cwd=folder, env=environ, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        with open(folder / "results.json") as f:
            return json.load(f)

    for student in students:
        results = grade(student)
        with open(out / "feedback" / student / "results.json") as f:
            notebooks = json.load(f)
        for n in CLASS_EXERCISES:
            graded, notebook = by_check(results, n), by_check(notebooks, n)
            assert graded == notebook, f"{student}, exercise {n}: make grade gave {graded}, nbgrader {notebook}"
            assert sum(graded.values()) == float(rows[student, f"ex{n}"]["score"]), (student, n)


def check_class_report(out, said):
    """grading/report.json and report.html: one row for the repeated mistake, the troubled submissions listed."""
    assert "class report:" in said, said
    with open(out / "report.json") as f:
        summary = json.load(f)
    sums = [
        m for m in summary["mistakes"] if "ex4 test_mydp_steps[2]" in m["checks"] and m["mistake"]["kind"] == "assert"
    ]
    assert len(sums) == 1, f"one mistake, one row: {[(m['title'], m['students']) for m in sums]}"
    assert sums[0]["students"] == ["mistakes", "sums_again", "sums_too"] and sums[0]["count"] == 3, sums[0]
    assert sums[0]["mistake"]["kind"] == "assert" and sums[0]["mistake"]["exercise"] == 4, sums[0]
    assert sums[0]["title"] == "gradients summed over the ranks, not averaged", "titled by what the check found"
    assert summary["mistakes"][0]["count"] == 3, "the most frequent mistake comes first"
    for student, kinds in (("crash", {"crash"}), ("mistakes", {"wait", "timeout", "p2p_deadlock"})):
        rows = [m["title"] for m in summary["mistakes"] if student in m["students"] and m["mistake"]["kind"] in kinds]
        assert len(rows) == 1, f"{student}: one mistake in worlds of every size, one row: {rows}"
    troubled = {(t["student"], t["what"]) for t in summary["troubled"]}
    assert {("crash", "crashed"), ("mistakes", "hung"), ("syntax", "did not import")} <= troubled, troubled
    assert not {t[0] for t in troubled} & {"sums_again", "sums_too"}, troubled
    timing = {t["student"]: t for t in summary["timing"]["by_student"]}
    assert sorted(timing) == sorted(LOST) and all(t["median_s"] > 0 for t in timing.values()), (
        "every submission's checks are timed, from the cells' execution times"
    )
    page = (out / "report.html").read_text()
    parsed = References()
    parsed.feed(page)
    assert parsed.found == [] and parsed.svgs >= 2 * len(summary["exercises"]), parsed.found
    top = subprocess.run(
        [sys.executable, "-m", "course.instructors.report", str(out), "--top", "5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert top.returncode == 0 and top.stdout.splitlines()[1].split()[:3] == ["3", "exercise", "4:"], top.stdout


@pytest.fixture
def checks_process():
    """check() keeps its process and that process's worlds for the next check, as in a kernel; a
    test ends them, so that a later test in this pytest process finds no workers of its own."""
    from course.grading.in_notebook import _stop_checks_process

    yield
    _stop_checks_process()


def test_a_check_runs_the_code_outside_the_kernel(tmp_path, monkeypatch, checks_process):
    """check() runs the submission's code in a process of its own: the kernel's probe finds none of it."""
    from checks.test_ex01_mlp import check_layers
    from course import impl
    from course.grading.in_notebook import CheckFailed, check, submission_modules

    folder = make_mutant(
        tmp_path / "stub",
        "mlp.py",
        "sizes = [config.d_in]",
        "raise NotImplementedError('Exercise 1: not yet')\n        sizes = [config.d_in]",
    )
    monkeypatch.setenv("COURSE_IMPL", folder)
    with pytest.raises(CheckFailed, match="Exercise 1: not yet"):
        check(check_layers)
    assert submission_modules(folder) == [], "the check ran the submission's code in this process"
    impl.load(folder)  # what a demo cell does, in a kernel that does not grade
    assert submission_modules(folder) == [f"{folder} (course.impl)"], "the probe must see code this process loaded"
    impl.forget(folder)


def records_pids(folder, path):
    """A check that notes its own process and the workers of its world of 2 (as this process sees
    them: a sandboxed worker is process 1 of a pid namespace of its own)."""
    from course.runtime.workers import kept_workers
    from tests.runtime.test_kept_worlds import pid

    world(pid, 2, expect=int)
    with open(path, "a") as f:
        f.write(json.dumps([os.getpid(), *kept_workers()]) + "\n")


def sleeps_in_a_world(folder, path):
    records_pids(folder, path)
    world(time.sleep, 2, 60, expect=None)


def test_a_kernels_checks_share_one_process_and_its_worlds(tmp_path, checks_process):
    from course.grading.in_notebook import check

    path = tmp_path / "pids"
    check(records_pids, path=str(path))
    check(records_pids, path=str(path))
    first, second = [json.loads(line) for line in path.read_text().splitlines()]
    assert first == second, "the second check started a process or a world again"
    assert os.getpid() not in first


def _to_the_process():
    os.kill(os.getpid(), signal.SIGINT)


def _to_another_thread():
    """Where a process-directed signal can land in a kernel with several threads (ipykernel's):
    Python acts on it in the main thread, which may be waiting in a read that no signal ends."""
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt here, as in a kernel (ipykernel sets it so): a test runner
    started in the background (`make test &`, nohup, some CI) has SIGINT ignored, and Python keeps
    it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("interrupt", [_to_the_process, _to_another_thread], ids=["process", "another_thread"])
def test_interrupting_a_check_stops_it_and_its_workers(tmp_path, checks_process, sigint_raises, interrupt):
    """Jupyter's interrupt is SIGINT to the kernel alone: the check and its world stop, the next check runs."""
    from course.grading.in_notebook import check
    from tests.runtime.test_launch import alive, wait_for

    path = tmp_path / "pids"
    check(records_pids, path=str(path))

    sent = []

    def interrupt_once_it_sleeps():
        wait_for(lambda: len(path.read_text().splitlines()) == 2, 30)
        time.sleep(0.2)
        sent.append((signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])))
        interrupt()

    threading.Thread(target=interrupt_once_it_sleeps, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        check(sleeps_in_a_world, path=str(path))
    # The world sleeps 60 s: ended in half of that, it was the interrupt that ended it, however loaded the machine.
    assert time.monotonic() - started < 30, f"SIGINT's handler and the blocked signals when it was sent: {sent}"
    stopped = json.loads(path.read_text().splitlines()[-1])
    assert not any(alive(p) for p in stopped)
    check(records_pids, path=str(path))
    assert set(json.loads(path.read_text().splitlines()[-1])).isdisjoint(stopped)


class _Kernels:
    """nbclient's NotebookClient as execute() uses it, with kernels that die as a list says: before
    their first cell ("start") or after it ("cell"), or not at all (None: every cell runs, and the
    probe shows `probe`, by default that the kernel held nothing)."""

    def __init__(self, deaths, probe=None):
        self.deaths, self.started, self.probe = list(deaths), 0, probe

    def __call__(self, nb, **options):
        from course.instructors.autograde import PROBE_MIME

        self.started += 1
        probe = self.probe or [{"output_type": "display_data", "data": {PROBE_MIME: []}, "metadata": {}}]
        death, cells = self.deaths.pop(0), nb.cells

        class Client:
            async def async_execute(self, env):
                if death == "start":
                    raise RuntimeError("Kernel died before replying to kernel_info")
                for cell in cells[: 1 if death == "cell" else len(cells)]:
                    cell.execution_count = 1
                if death == "cell":
                    raise RuntimeError("Kernel died")
                cells[-1].outputs = probe

        return Client()


@pytest.mark.parametrize(
    "deaths, kernels, graded",
    [(["start", None], 2, 2), (["cell"], 1, 1), (["start", "start"], 2, 0)],
    ids=["at_start_once", "after_a_cell", "at_start_twice"],
)
def test_a_kernel_that_dies_before_its_first_cell_is_started_again(tmp_path, monkeypatch, deaths, kernels, graded):
    """Only a kernel that ran nothing is replaced; the cells no kernel ran are not graded, with the reason."""
    import asyncio

    import nbclient
    import nbformat

    from course.instructors.autograde import execute

    path = tmp_path / "submitted" / "s" / "ex1" / "01_mlp.ipynb"
    path.parent.mkdir(parents=True)
    nbformat.write(
        nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1"), nbformat.v4.new_code_cell("2")]), path
    )
    started = _Kernels(deaths)
    monkeypatch.setattr(nbclient, "NotebookClient", started)
    asyncio.run(execute(str(tmp_path), "s", {"ex1": "01_mlp"}, str(tmp_path), 60))
    cells = nbformat.read(path, as_version=4).cells
    assert started.started == kernels
    assert sum(c.execution_count is not None for c in cells) == graded
    assert all("could not be graded: RuntimeError: Kernel died" in c.outputs[0]["evalue"] for c in cells[graded:])


def test_autograde_refuses_an_exercise_that_does_not_exist(tmp_path):
    from course.instructors.autograde import _nbgrader_config, make_assignments

    with pytest.raises(RuntimeError, match=r"no exercise \[99\]; exercises are \[1, "):
        make_assignments(str(tmp_path), _nbgrader_config(str(tmp_path)), [99])


def test_a_notebook_that_is_not_one_costs_its_own_answers_only(tmp_path, monkeypatch):
    """A written answer whose source is not text, or a file that is not JSON: that student's answers
    are empty, with the reason, and the notebooks made for grading still parse (the class goes on)."""
    import nbformat
    import nbgrader.api

    from course.instructors.autograde import _gradebook_version, _nbgrader_config, make_assignments, take_in

    monkeypatch.setattr(nbgrader.api, "get_alembic_version", _gradebook_version)  # as main() does

    out = tmp_path / "out"
    assignments = make_assignments(str(out), _nbgrader_config(str(out)), [2, 4])
    submission = tmp_path / "student"
    _unreadable_notebooks(str(submission))
    _, problems = take_in(str(submission), "student", str(out), assignments)
    assert tuple(problems) == UNREADABLE, problems
    for assignment, stem in assignments.items():
        nbformat.read(out / "submitted" / "student" / assignment / f"{stem}.ipynb", as_version=4)


def test_a_late_students_run_keeps_the_rest_of_the_class(tmp_path):
    """Issue 28: re-running one late student replaced the whole report, and that student's other
    exercises. Each student's checks are merged by exercise, and the report is the whole class's."""
    from course.grading.results import Check
    from course.instructors.autograde import graded_before, merge

    first = [Check(2, "test_by_row[2]", True, "", 3), Check(4, "test_start_sync[2]", False, "x", 4)]
    for student in ("ada", "ben"):
        merge(str(tmp_path / "feedback" / student), first)
    again = merge(str(tmp_path / "feedback" / "ada"), [Check(4, "test_start_sync[2]", True, "", 4)])
    assert [(c.exercise, c.passed) for c in again] == [(2, True), (4, True)]
    assert {s: [c.passed for c in checks] for s, checks in graded_before(str(tmp_path)).items()} == {
        "ada": [True, True],
        "ben": [True, False],
    }
