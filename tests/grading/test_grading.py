"""The grading product: `make grade`'s plugin, the notebooks, the students' release."""

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from course import impl
from course.exercises import STUDENT_FILES
from course.grading import points as checks
from course.grading.explain import explain
from course.instructors import make_notebooks as notebooks
from course.instructors.release import leaks, release, secret_lines
from course.instructors.student import ROOT, SOLUTIONS
from course.launch import WorldFailed, run
from course.layout import graded_elsewhere, graded_exercises
from course.runtime import sandbox
from course.runtime.processes import OwnTime, descendants
from tests import warm
from tests.grading.test_grades_unchanged import compare
from tests.mutants import does_nothing, make_mutant

TESTS = os.path.join(ROOT, "checks")


# A grade of every exercise: a bound on a hang, not on speed (under make test's two processes at a load
# of 15, 120 s was not enough).
WHOLE_COURSE = 300


def exercise_modules():
    return sorted(name for name in os.listdir(TESTS) if re.fullmatch(r"test_ex\d+_\w+\.py", name))


def test_the_table_of_points_is_what_pytest_collects():
    """course/grading/points.py names every case as pytest does, with the points the grader gives it."""

    class Collector:
        items = []

        def pytest_collection_finish(self, session):
            self.items = list(session.items)

    from course.grading.plugin import _points

    for module in checks.modules():
        collector = Collector()
        path = os.path.join(ROOT, module.replace(".", os.sep) + ".py")
        assert pytest.main(["--collect-only", "-qq", "-p", "no:cacheprovider", path], plugins=[collector]) == 0
        graded = [i for i in collector.items if not i.get_closest_marker("scaffold")]
        assert [(i.name, _points(i)) for i in graded] == [(c.name, c.points) for c in checks.of_module(module)]


def test_every_check_has_whole_points_and_its_notebook_runs_it():
    """One table, both paths: each check of `make grade` is one grade() cell of its exercise's notebook,
    worth what its cases are worth."""
    for source in notebooks.sources():
        exercise = notebooks.exercise_of(source)
        cells = notebooks.notebook(source)["cells"]
        graded = [c for c in cells if c["metadata"].get("nbgrader", {}).get("grade") and c["cell_type"] == "code"]
        found = checks.of_module(notebooks.check_module(exercise))
        tests = list(dict.fromkeys(case.test for case in found))
        assert [c["source"] for c in graded] == [f"grade({t})" for t in tests], f"{source}: one grade() cell per check"
        for cell in graded:
            cases = [c for c in found if f"grade({c.test})" == cell["source"]]
            assert cell["metadata"]["nbgrader"]["points"] == sum(c.points for c in cases)
            assert cell["metadata"]["course"]["cases"] == [{"name": c.name, "points": c.points} for c in cases]
        assert sum(c["metadata"]["nbgrader"]["points"] for c in graded) == checks.points()[exercise]
        # What the grade() cells name, the notebook's code imports (else NameError at autograde, not here).
        code = "\n".join(c["source"] for c in cells if c["cell_type"] == "code" and c not in graded)
        names = {name for node in ast.walk(ast.parse(code)) if isinstance(node, ast.ImportFrom) for name in node.names}
        imported = {alias.asname or alias.name for alias in names}
        assert set(tests) <= imported, f"{source}: grade() of checks it never imports: {sorted(set(tests) - imported)}"


@pytest.mark.parametrize("source", notebooks.sources(), ids=os.path.basename)
def test_student_notebook_is_generated_from_source(source):
    with open(notebooks.student_path(source)) as f:
        assert f.read() == notebooks.dumps(notebooks.notebook(source, solutions=False)), "run `make student`"


@pytest.mark.parametrize("source", notebooks.sources(), ids=os.path.basename)
def test_notebook_demos_run(source, impl_dir, monkeypatch):
    """The demo cells, which autograding leaves out, run here, on the implementation under test."""
    monkeypatch.setenv("COURSE_IMPL", impl_dir)
    cells = notebooks.notebook(source, solutions=False)["cells"]
    setup = next(c for c in cells if c["cell_type"] == "code")
    demos = [c for c in cells if "demo" in c["metadata"].get("tags", [])]
    assert demos, "each notebook runs the student's code at least once"
    namespace = {}
    for cell in [setup] + demos:
        exec(compile(cell["source"], cell["id"], "exec"), namespace)


def stub(message):
    raise NotImplementedError(message)


def one_rank_asserts():
    assert dist.get_rank() == 0, "rank 1 computed the wrong thing"


def test_explain_says_what_a_world_found():
    with pytest.raises(WorldFailed) as caught:
        run(stub, 2, "Exercise 2: f is not written yet, see exercises/02_dist.md")
    assert explain(caught.value) == "Exercise 2: f is not written yet, see exercises/02_dist.md"
    with pytest.raises(WorldFailed) as caught:
        run(one_rank_asserts, 2)
    assert explain(caught.value) == (
        "Rank 1 of 2 failed first: AssertionError: rank 1 computed the wrong thing (at test_grading.py:"
        f"{one_rank_asserts.__code__.co_firstlineno + 1} in one_rank_asserts)"
    )
    try:
        assert 1 + 1 == 3, "the sum is wrong"
    except AssertionError as error:  # rewritten by pytest: the message comes first, then the expression
        assert explain(error) == "the sum is wrong"
    assert explain(ValueError("bad\nvalue")) == "ValueError: bad"


def test_a_broken_file_fails_only_the_exercises_that_use_it(tmp_path):
    for name in STUDENT_FILES:
        shutil.copy(os.path.join(SOLUTIONS, name), tmp_path)
    (tmp_path / "dist.py").write_text("def broken(:\n")
    (tmp_path / "mydp.py").unlink()
    ex = impl.load(tmp_path)
    assert ex.mlp.ModelConfig().d_in == 1024
    with pytest.raises(ImportError, match=r"dist.py does not import: SyntaxError"):
        _ = ex.dist.par_matmul_by_row
    with pytest.raises(ImportError, match=r"mydp.py does not import: FileNotFoundError"):
        _ = ex.mydp.MyDP


@pytest.mark.parametrize("mistake", ["def broken(:\n", "raise NameError('oops')\n"])
def test_a_file_that_does_not_import_is_named_by_the_files_that_import_it(tmp_path, mistake):
    """mydp.py imports mlp.py: a mistake in mlp.py is mlp.py's, whichever exercise meets it first."""
    for name in STUDENT_FILES:
        shutil.copy(os.path.join(SOLUTIONS, name), tmp_path)
    with open(tmp_path / "mlp.py", "a") as f:
        f.write(mistake)
    ex = impl.load(tmp_path)
    with pytest.raises(ImportError, match=r"^mlp.py does not import: (SyntaxError|NameError)"):
        _ = ex.mydp.MyDP


FAKE_CHECKS = """
import pytest

@pytest.mark.points(10)
def test_passes():
    pass

@pytest.mark.points(7)
def test_fails():
    assert 1 == 2, "one is not two: fix the arithmetic"

@pytest.mark.scaffold
def test_given_code():
    pass
"""


def grade(folder, *args):
    return warm.run(["-m", "pytest", "-p", "course.grading.plugin", "-p", "no:cacheprovider", *args], cwd=folder)


def test_grade_scores_checks_and_exits_0_for_a_low_grade(tmp_path):
    (tmp_path / "test_ex01_fake.py").write_text(FAKE_CHECKS)
    done = grade(tmp_path, "-n", "2", "test_ex01_fake.py")  # through pytest-xdist, as make grade
    assert done.returncode == 0, done.stdout + done.stderr
    assert "x test_fails: one is not two: fix the arithmetic" in done.stdout
    assert "Traceback" not in done.stdout
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    assert results["score"] == 10 and {
        t["name"]: (t["score"], t["max_score"], t["status"]) for t in results["tests"]
    } == {
        "Exercise 1: test_passes": (10, 10, "passed"),
        "Exercise 1: test_fails": (0, 7, "failed"),
    }, "each check earns its own points, the scaffold check nothing"
    assert (
        all(t["visibility"] == "visible" and t["output"] is not None for t in results["tests"])
        and "execution_time" in results
    )
    failed = next(t for t in results["tests"] if t["status"] == "failed")
    assert failed["extra_data"]["mistake"] == {
        "kind": "assert",
        "file": "test_ex01_fake.py",
        "func": "test_fails",
        "line": FAKE_CHECKS.splitlines().index('    assert 1 == 2, "one is not two: fix the arithmetic"') + 1,
    }, "the failed check's facts, from the worker that ran it (pytest-xdist) to results.json"


PID_CHECKS = """
import os
import pytest

pytestmark = pytest.mark.points(1)

def test_a():
    assert False, f"pid {os.getpid()}"

def test_b():
    assert False, f"pid {os.getpid()}"

def test_c():
    assert False, f"pid {os.getpid()}"
"""


def test_a_check_without_points_stops_the_grader_and_says_so(tmp_path):
    (tmp_path / "test_ex01_bare.py").write_text("def test_x():\n    pass\n")
    done = grade(tmp_path, "test_ex01_bare.py")
    assert done.returncode != 0 and "test_x has no points: mark it @pytest.mark.points(N)" in done.stdout
    with open(tmp_path / "results.json") as f:
        assert "could not be graded" in json.load(f)["output"]


def test_grading_processes_share_the_checks(tmp_path):
    (tmp_path / "test_ex01_pids.py").write_text(PID_CHECKS)
    for processes, expected in ((2, 2), (5, 3)):  # never more processes than checks
        done = grade(tmp_path, "--grade-processes", str(processes), "test_ex01_pids.py")
        assert done.returncode == 0, done.stdout + done.stderr
        with open(tmp_path / "results.json") as f:
            tests = json.load(f)["tests"]
        assert [t["name"] for t in tests] == [f"Exercise 1: test_{c}" for c in "abc"]
        pids = {t["output"] for t in tests}
        assert len(pids) == expected and all(p.startswith("pid ") for p in pids), (processes, pids)


def test_the_grader_forks_a_second_process_only_where_workers_are_forked(monkeypatch):
    from course.grading.share import processes_here
    from course.runtime import env

    monkeypatch.setattr(env, "usable_cores", lambda: 2)
    for method, processes in (("fork", 2), ("forkserver", 1), ("spawn", 1)):
        monkeypatch.setenv("COURSE_START_METHOD", method)  # macOS gets forkserver, Windows spawn
        assert processes_here() == processes, method
    monkeypatch.setenv("COURSE_START_METHOD", "fork")
    monkeypatch.setattr(env, "usable_cores", lambda: 1)
    assert processes_here() == 1, "one core: one process"


def test_two_grading_processes_grade_as_one(tmp_path):
    """The same verdicts, messages and facts whichever process ran a check."""
    folder = make_mutant(tmp_path / "sums", "mydp.py", "mean = grad / dist.get_world_size()", "mean = grad.clone()")
    results = []
    for processes in (1, 2):
        audit = tmp_path / f"imports-{processes}.txt"
        done = warm.grade(
            *("--ex", "4", "--", "--grade-processes", str(processes), "-p", "tests.import_audit"),
            impl=folder,
            cwd=tmp_path,
            env={"COURSE_IMPORT_AUDIT": str(audit)},
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert not audit.exists(), f"imported once submission code could run: {audit.read_text()}"
        with open(tmp_path / "results.json") as f:
            results.append(json.load(f))
        results[-1].pop("execution_time")
    assert results[0] == results[1]
    assert 0 < results[0]["score"] < checks.points()[4], "some checks of exercise 4 fail on summed gradients, not all"


def test_a_broken_grader_exits_non_zero(tmp_path):
    (tmp_path / "test_ex01_fixture.py").write_text(
        "import pytest\n\n@pytest.fixture\ndef data():\n    raise OSError('no data')\n\n@pytest.mark.points(1)\ndef test_x(data):\n    pass\n"
    )
    done = grade(tmp_path, "test_ex01_fixture.py")
    assert done.returncode != 0 and "GRADER ERROR" in done.stdout, done.stdout


def test_a_module_of_checks_that_does_not_import_is_a_grader_error_not_a_ctrl_c(tmp_path):
    """pytest stops a session whose modules do not all import with its own KeyboardInterrupt (Session.Interrupted):
    the grade names the module, and does not say that Ctrl-C stopped it."""
    (tmp_path / "test_ex01_broken.py").write_text("import no_such_module\n")
    done = grade(tmp_path, "test_ex01_broken.py")
    said = "GRADER ERROR (not your code): test_ex01_broken.py could not be collected"
    assert done.returncode == 1 and said in done.stdout and "Interrupted: no grade" not in done.stdout, done.stdout
    with open(tmp_path / "results.json") as f:
        assert said in json.load(f)["output"]


def test_no_check_gives_points_to_code_that_does_nothing(tmp_path):
    """Every TODO answered by `pass`: no check of any exercise passes (points for nothing)."""
    folder = does_nothing(tmp_path / "nothing")
    done = warm.grade(impl=folder, cwd=tmp_path, timeout=WHOLE_COURSE)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(tmp_path / "results.json") as f:
        found = json.load(f)
    passed = [t["name"] for t in found["tests"] if t["status"] == "passed"]
    assert (
        found["score"] == 0
        and not passed
        and len(found["tests"]) == sum(map(len, map(checks.of_module, checks.modules())))
    ), passed
    differ = compare(found["tests"], "does_nothing")  # and each sentence is what it was before issue 46's move
    assert not differ, "\n".join(differ)


def test_release_has_no_solution_and_grades_an_untouched_clone(tmp_path):
    dest = tmp_path / "release"
    files = release(str(dest))
    assert not any(
        f.startswith(("solutions", ".ci")) or "mutant" in f or f == "tests/authoring/test_student_files.py"
        for f in files
    )
    assert not {
        "course/instructors/autograde.py",
        "course/instructors/release.py",
        "course/instructors/student.py",
        "docs/instructors.md",
    } & set(files)
    assert {
        "mlp.py",
        "Makefile",
        "checks/test_ex02_dist.py",
        "exercises/03_ddp.ipynb",
        "course/grading/plugin.py",
        "exercises/06_timeline.svg",
        "docs/trust.md",
    } <= set(files)
    assert leaks(str(dest)) == []
    secret = sorted(secret_lines())[0]
    (dest / "notes.txt").write_text(f"  {secret}\n")
    assert leaks(str(dest)) == [("notes.txt", secret)], "the leak check must find a solution line"
    (dest / "notes.txt").unlink()

    dry = subprocess.run(["make", "-n", "test"], cwd=dest, capture_output=True, text=True, timeout=60)
    assert "-m course grade" in dry.stdout and "COURSE_IMPL=solutions" not in dry.stdout, (
        "without solutions/, make test is make grade"
    )
    audit = tmp_path / "imports.txt"  # the stubs of every exercise: each check's failure path
    (dest / "tests").mkdir()  # the test's own instrument, which the students' copy has not
    (dest / "tests" / "__init__.py").write_text("")
    shutil.copy(os.path.join(ROOT, "tests", "import_audit.py"), dest / "tests")
    done = subprocess.run(
        [sys.executable, "-m", "course", "grade", "--", "-p", "tests.import_audit"],
        cwd=dest,
        env=dict(os.environ, COURSE_IMPL="student", COURSE_IMPORT_AUDIT=str(audit)),
        capture_output=True,
        text=True,
        timeout=WHOLE_COURSE,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not audit.exists(), f"imported once submission code could run: {audit.read_text()}"
    with open(dest / "results.json") as f:
        results = json.load(f)
    assert results["score"] == 0 and results["tests"]
    differ = compare(results["tests"], "stubs")  # each sentence is what it was before issue 46's move
    assert not differ, "\n".join(differ)
    messages, exercise = {}, None
    for line in done.stdout[done.stdout.index("exercise") :].splitlines():
        if re.match(r" +\d+ ", line):
            exercise = int(line.split()[0])
        elif line.strip().startswith("x "):
            messages.setdefault(exercise, []).append(line)
    assert sorted(messages) == graded_exercises() and all(
        len(m) == 1 and "not written yet" in m[0] for m in messages.values()
    ), messages


def test_grade_names_the_exercises_when_there_is_no_such_one(tmp_path):
    """...and its results.json says that the submission could not be graded: no plausible 0."""
    exercises = graded_exercises()
    missing = max(exercises) + 1
    done = warm.grade("--ex", "2", "--ex", str(missing), impl=ROOT, cwd=tmp_path)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.strip() == f"no exercise {missing}; exercises are {min(exercises)}–{max(exercises)}"
    with open(tmp_path / "results.json") as f:
        found = json.load(f)
    assert "could not be graded" in found["output"] and found["tests"][0]["name"] == "The grader", found


def test_grade_says_which_folder_it_grades_when_not_the_current_one(tmp_path):
    """Two clones sharing one .venv: the grade run in the second grades the first's files, and says so."""
    other = tmp_path / "other-clone"
    (other / "course").mkdir(parents=True)
    (other / "course" / "layout.py").write_text("")
    (other / "exercises").mkdir()
    assert graded_elsewhere(ROOT) is None and graded_elsewhere(os.path.join(ROOT, "exercises")) is None
    said = graded_elsewhere(str(other / "exercises"))
    assert said and f"Grading the files in {ROOT}" in said and f"you are in {other}" in said, said
    assert "in no copy of the course" in graded_elsewhere(str(tmp_path))
    # From the other clone's subfolder, `python -m course` imports this repository's package (the
    # editable install), as a second clone sharing this .venv would.
    done = subprocess.run(
        [sys.executable, "-m", "course", "grade", "--ex", "0"],
        cwd=other / "exercises",
        env={k: v for k, v in os.environ.items() if k != "COURSE_IMPL"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.startswith(f"Grading the files in {ROOT}"), done.stderr


def _named(pids, name):
    """Whether a process of pids is named name (its comm)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == name:
                    return True
        except OSError:
            pass
    return False


def _running(pid):
    """Whether pid is a process that has not ended (not gone, not a zombie), and its process group."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
    except (OSError, ValueError):
        return False, None
    return state != "Z", int(group)


def _left_by(grader, before, folder):
    """The processes a grader left running, with their command lines: what it started (this process is a
    child subreaper, so its orphans come here), its process group, and any whose working folder is in
    folder (its worlds')."""
    found = set(descendants([os.getpid()])) - before
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            inside = os.readlink(f"/proc/{pid}/cwd").startswith(str(folder))
        except OSError:
            inside = False
        if inside or _running(pid)[1] == grader:
            found.add(pid)
    left = {}
    for pid in sorted(found - {os.getpid()}):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                command = f.read().replace("\0", " ")
        except OSError:
            continue
        if _running(pid)[0]:
            left[pid] = command
    return left


# Issue 49: where the test's Ctrl-C lands, each a moment that tests/grading/ctrl_c_moments.py holds the grade at.
CTRL_C_MOMENTS = ["configuring", "collecting", "world-starts", "check-runs", "copy-checks", "results"]


def ctrl_c_at(moment, folder):
    """Grade exercise 2 of the reference beside a busy process (`python -c 'while True: pass'`), and send
    SIGINT to the grader's process group, as a terminal's Ctrl-C does, once the grade is at moment.
    Returns ((the grader's own seconds from the signal to its exit, and the wall's), its exit status, its output,
    the processes it left). Its own time (course/runtime/processes.py's OwnTime: the wall time less what its
    processes waited for a CPU) is what a loaded machine cannot stretch: run 71 of the series, beside the suite's
    other worker, took 5 to 15.6 s of wall time at every moment, where a grader that waits for a timer or a
    process that never ends still spends its own."""
    sandbox.adopt_orphans()  # what the grader leaves comes to this process, to be found
    notes, out = folder / "notes", folder / "out"
    notes.touch()
    before = set(descendants([os.getpid()]))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with open(out, "w") as output:
            grader = subprocess.Popen(
                # Two grading processes, whatever this machine's cores (make test's processes have one each).
                [sys.executable, "-m", "course", "grade", "--ex", "2", "--", "--grade-processes", "2"]
                + ["-p", "tests.grading.ctrl_c_moments"],
                cwd=folder,
                env=dict(os.environ, COURSE_IMPL=SOLUTIONS, COURSE_CTRL_C_AT=moment, COURSE_CTRL_C_NOTES=str(notes)),
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # As a terminal gives it, whatever this runner inherited: a `make test &` ignores SIGINT, and
                # passes that on (issue 16), and a grader that ignores Ctrl-C is right to go on.
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )

        def there():  # a sandboxed worker can write no note: it takes a name
            if moment == "check-runs":
                return _named(descendants([grader.pid]), "ctrl-c-check")
            return f"{moment}\n" in notes.read_text()

        # However long a loaded machine takes to get there: decided by the event, never by a time.
        deadline = time.monotonic() + WHOLE_COURSE
        while not there() and grader.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert there(), f"the grade did not reach {moment}: {out.read_text()}"
        os.killpg(grader.pid, signal.SIGINT)
        sent, clock = time.monotonic(), OwnTime([grader.pid])
        with open(notes, "a") as f:
            f.write("sent\n")
        try:
            own = 0.0
            while grader.poll() is None and time.monotonic() - sent < 60:
                own = clock.elapsed()  # its last reading before the exit: the kernel forgets an ended process
                time.sleep(0.05)
        finally:
            took = (own, time.monotonic() - sent)
            if grader.poll() is None:
                os.killpg(grader.pid, signal.SIGKILL)
                grader.wait()
    finally:
        busy.kill()
        busy.wait()
    # A process killed ends for certain, in seconds on a loaded machine; one the grader did not stop never does.
    deadline = time.monotonic() + 30
    while _left_by(grader.pid, before, folder) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _left_by(grader.pid, before, folder)
    for pid in set(descendants([os.getpid()])) - before:  # the grader's orphans, here: killed and reaped
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass
    return took, grader.returncode, out.read_text(), left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the grader forks its copy on Linux")
@pytest.mark.parametrize("moment", CTRL_C_MOMENTS)
def test_ctrl_c_stops_a_grade_at_any_moment(tmp_path, moment):
    """Issue 49: Ctrl-C at each moment of a grade, under load: within 5 s of its own time the grader ends, says it was
    interrupted, gives no table and no score, and leaves no process behind."""
    (own, wall), code, out, left = ctrl_c_at(moment, tmp_path)
    assert own < 5, f"{own:.1f} s of the grader's own time ({wall:.1f} s of wall time) from Ctrl-C to its end: {out}"
    assert code != 0 and "Interrupted: no grade (results.json says so)." in out and "total" not in out, out
    with open(tmp_path / "results.json") as f:
        found = json.load(f)
    assert "interrupted" in found["output"] and found["tests"][0]["name"] == "The grader", found
    assert not left, f"left running: {left}"


def test_several_exercises_in_one_run(tmp_path):
    """A weekly assignment: `--ex 6 --ex 7` (make grade EX="6 7") grades both, and only them."""
    done = warm.grade("--ex", "7", "--ex", "5", impl=SOLUTIONS, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(tmp_path / "results.json") as f:
        found = json.load(f)
    points = checks.points()
    assert {t["name"].split(":")[0] for t in found["tests"]} == {"Exercise 5", "Exercise 7"}
    assert found["score"] == points[5] + points[7], found["output"]


def test_a_syntax_error_is_said_once_and_no_pytest_summary_follows_the_table(tmp_path):
    for name in STUDENT_FILES:
        shutil.copy(os.path.join(ROOT, name), tmp_path)
    (tmp_path / "mlp.py").write_text("def broken(:\n")
    done = warm.grade("--ex", "1", impl=tmp_path, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stdout[done.stdout.index("exercise") :]
    assert table.count("mlp.py does not import: SyntaxError") == 1, table
    assert re.search(r"\d+ (failed|passed)", done.stdout) is None, done.stdout
    with open(tmp_path / "results.json") as f:
        assert all("mlp.py does not import: SyntaxError" in t["output"] for t in json.load(f)["tests"])


def grading_plugin(folder, name, text):
    """A module of folder that the grader loads with `-p NAME` (PYTHONPATH): it sets what the test needs."""
    (folder / f"{name}.py").write_text(text)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


def test_an_endless_loop_costs_its_exercise_one_world_limit_not_one_per_check(tmp_path):
    """Issue 28: once a world of an exercise has run out of time, the exercise's later checks (in the
    same grading process) get worlds of env.HANG_WORLD_LIMIT seconds; another exercise graded in the
    same run, of the same file here, keeps its points. Here the worlds' limit is 4 s and the short
    one 1 s, so each world's sentence says which it got."""
    from course.grading.share import processes_here

    folder = make_mutant(
        tmp_path / "loops",
        "dist.py",
        '    """Rank 0 tells every rank the shapes (m, k, n) and the dtype; returns them on every rank."""\n',
        '    """Rank 0 tells every rank the shapes (m, k, n) and the dtype; returns them on every rank."""\n'
        "    while True:\n        pass\n",
    )
    environ = {"COURSE_TIMEOUT": "4"} | grading_plugin(
        tmp_path, "short_hang", "from course.runtime import env\n\nenv.HANG_WORLD_LIMIT = 1\n"
    )
    done = warm.grade("--ex", "2", "--ex", "5", "--", "-p", "short_hang", impl=folder, cwd=tmp_path, env=environ)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(tmp_path / "results.json") as f:
        tests = json.load(f)["tests"]
    ring = [t for t in tests if t["name"].startswith("Exercise 5:")]
    assert all(t["status"] == "passed" for t in ring) and sum(t["score"] for t in ring) == checks.points()[5]
    limits = sorted(re.match(r"Timed out after (\d+) s", t["output"])[1] for t in tests if t not in ring)
    processes = processes_here()  # each grading process meets the loop once at the full limit
    cases = len(checks.of_module("checks.test_ex02_dist"))
    assert limits == ["1"] * (cases - processes) + ["4"] * processes, limits


def test_the_short_limit_never_lengthens_a_world(monkeypatch):
    """With COURSE_TIMEOUT under env.HANG_WORLD_LIMIT, an exercise that ran out of time keeps it."""
    from types import SimpleNamespace

    from course.grading import plugin as grade
    from course.runtime import env

    monkeypatch.setattr(grade, "_out_of_time", {2})
    for usual, short in (("600", f"{env.HANG_WORLD_LIMIT}"), ("4", "4"), (None, f"{env.HANG_WORLD_LIMIT}")):
        if usual is None:
            monkeypatch.delenv("COURSE_TIMEOUT", raising=False)
        else:
            monkeypatch.setenv("COURSE_TIMEOUT", usual)
        for nodeid, limit in (
            ("checks/test_ex02_dist.py::test_by_row[2]", short),
            ("checks/test_ex01_mlp.py::t", usual),
        ):
            hook = grade.pytest_runtest_call(SimpleNamespace(nodeid=nodeid))
            next(hook)
            assert os.environ.get("COURSE_TIMEOUT") == limit, (usual, nodeid)
            with pytest.raises(StopIteration):
                hook.send(None)
            assert os.environ.get("COURSE_TIMEOUT") == usual, "and the usual limit comes back"


def test_a_required_sandbox_that_this_machine_cannot_give_is_a_grader_error(tmp_path):
    """COURSE_SANDBOX=required where no sandbox can be had (each level's probe fails, as on a
    machine without user namespaces, not root): exit status 1, the sentence, no check run, no score."""
    probes = (
        "from course.runtime import sandbox\n\n"
        "sandbox._PROBES.update(uid=lambda *_: ('no user here', ''), namespaces=lambda *_: ('no namespaces here', ''))\n"
    )
    environ = {"COURSE_SANDBOX": "required"} | grading_plugin(tmp_path, "no_sandbox", probes)
    done = warm.grade("--ex", "2", "--", "-p", "no_sandbox", impl=ROOT, cwd=tmp_path, env=environ)
    said = re.search(
        r"GRADER ERROR \(not your code\): (COURSE_SANDBOX=required, and it is not possible here: .*)", done.stdout
    )
    assert done.returncode == 1 and said, done.stdout + done.stderr
    assert sys.platform != "linux" or "namespaces: no namespaces here" in said[1], said[1]  # and uid's, as root
    with open(tmp_path / "results.json") as f:
        found = json.load(f)
    assert "could not be graded, so 0 is not its score" in found["output"] and said[1] in found["output"], found
    assert [(t["name"], t["max_score"]) for t in found["tests"]] == [("The grader", 0)], found
