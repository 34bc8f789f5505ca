"""The grading product: `make grade`'s plugin, the notebooks, the students' release."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch.distributed as dist

from course import impl
from course import make_notebooks as notebooks
from course.grade import POINTS, explain
from course.launch import WorldFailed, run
from course.release import leaks, release, secret_lines
from course.student import ROOT, SOLUTIONS, STUDENT_FILES
from tests import warm
from tests.mutants import make_mutant

TESTS = os.path.join(ROOT, "tests")


def exercise_modules():
    return sorted(name for name in os.listdir(TESTS) if re.fullmatch(r"test_ex\d+_\w+\.py", name))


def test_every_exercise_has_points_and_its_notebook_gives_them():
    for name in exercise_modules():
        assert int(re.match(r"test_ex(\d+)_", name).group(1)) in POINTS, (
            f"{name}: add its exercise to POINTS in course/grade.py"
        )
    for source in notebooks.sources():
        cells = notebooks.notebook(source)["cells"]
        tests = [c for c in cells if c["metadata"].get("nbgrader", {}).get("grade") and c["cell_type"] == "code"]
        points = sum(c["metadata"]["nbgrader"]["points"] for c in tests)
        assert points == POINTS[notebooks.exercise_of(source)], f"{source}: its test cells give {points} points"
        setup = next(c["source"] for c in cells if c["cell_type"] == "code")
        imported = {
            alias.name
            for node in ast.walk(ast.parse(setup))
            if isinstance(node, ast.ImportFrom) and node.module.startswith("tests.")
            for alias in node.names
        }
        for cell in tests:
            call = ast.parse(cell["source"]).body[0].value
            assert call.func.id == "check" and call.args[0].id in imported, (
                f"{cell['id']} must call check(check_..., ...) with a check from tests/"
            )


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


FAKE_CHECKS = """
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two: fix the arithmetic"

@pytest.mark.scaffold
def test_given_code():
    pass
"""


def grade(folder, *args):
    return warm.run(["-m", "pytest", "-p", "course.grade", "-p", "no:cacheprovider", *args], cwd=folder)


def test_grade_scores_checks_and_exits_0_for_a_low_grade(tmp_path):
    (tmp_path / "test_ex1_fake.py").write_text(FAKE_CHECKS)
    done = grade(tmp_path, "-n", "2", "test_ex1_fake.py")  # through pytest-xdist, as make grade
    assert done.returncode == 0, done.stdout + done.stderr
    assert "x test_fails: one is not two: fix the arithmetic" in done.stdout
    assert "Traceback" not in done.stdout
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    assert results["score"] == 10 and {
        t["name"]: (t["score"], t["max_score"], t["status"]) for t in results["tests"]
    } == {
        "Exercise 1: test_passes": (10, 10, "passed"),
        "Exercise 1: test_fails": (0, 10, "failed"),
    }, "the scaffold check earns nothing and the two others share exercise 1's 20 points"
    assert (
        all(t["visibility"] == "visible" and t["output"] is not None for t in results["tests"])
        and "execution_time" in results
    )
    failed = next(t for t in results["tests"] if t["status"] == "failed")
    assert failed["extra_data"]["mistake"] == {
        "kind": "assert",
        "file": "test_ex1_fake.py",
        "func": "test_fails",
        "line": FAKE_CHECKS.splitlines().index('    assert 1 == 2, "one is not two: fix the arithmetic"') + 1,
    }, "the failed check's facts, from the worker that ran it (pytest-xdist) to results.json"


PID_CHECKS = """
import os

def test_a():
    assert False, f"pid {os.getpid()}"

def test_b():
    assert False, f"pid {os.getpid()}"

def test_c():
    assert False, f"pid {os.getpid()}"
"""


def test_grading_processes_share_the_checks(tmp_path):
    (tmp_path / "test_ex1_pids.py").write_text(PID_CHECKS)
    for processes, expected in ((2, 2), (5, 3)):  # never more processes than checks
        done = grade(tmp_path, "--grade-processes", str(processes), "test_ex1_pids.py")
        assert done.returncode == 0, done.stdout + done.stderr
        with open(tmp_path / "results.json") as f:
            tests = json.load(f)["tests"]
        assert [t["name"] for t in tests] == [f"Exercise 1: test_{c}" for c in "abc"]
        pids = {t["output"] for t in tests}
        assert len(pids) == expected and all(p.startswith("pid ") for p in pids), (processes, pids)


def test_the_grader_forks_a_second_process_only_where_workers_are_forked(monkeypatch):
    from course import env
    from course.grade import processes_here

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
        done = course_grade(
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
    assert 0 < results[0]["score"] < POINTS[4], "some checks of exercise 4 fail on summed gradients, not all"


def test_a_broken_grader_exits_non_zero(tmp_path):
    (tmp_path / "test_ex1_fixture.py").write_text(
        "import pytest\n\n@pytest.fixture\ndef data():\n    raise OSError('no data')\n\ndef test_x(data):\n    pass\n"
    )
    done = grade(tmp_path, "test_ex1_fixture.py")
    assert done.returncode != 0 and "GRADER ERROR" in done.stdout, done.stdout
    (tmp_path / "test_ex99_new.py").write_text("def test_x():\n    pass\n")
    assert grade(tmp_path, "test_ex99_new.py").returncode != 0, "an exercise without points must stop the grader"


def test_release_has_no_solution_and_grades_an_untouched_clone(tmp_path):
    dest = tmp_path / "release"
    files = release(str(dest))
    assert not any(
        f.startswith(("solutions", ".ci")) or "mutant" in f or f == "tests/test_student_files.py" for f in files
    )
    assert {
        "mlp.py",
        "Makefile",
        "tests/test_ex2_dist.py",
        "exercises/03_ddp.ipynb",
        "course/grade.py",
        "exercises/06_timeline.svg",
        "docs/class-report.png",
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
    shutil.copy(os.path.join(ROOT, "tests", "import_audit.py"), dest / "tests")  # the test's own instrument
    done = subprocess.run(
        [sys.executable, "-m", "course", "grade", "--", "-p", "tests.import_audit"],
        cwd=dest,
        env=dict(os.environ, COURSE_IMPL="student", COURSE_IMPORT_AUDIT=str(audit)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not audit.exists(), f"imported once submission code could run: {audit.read_text()}"
    with open(dest / "results.json") as f:
        results = json.load(f)
    assert results["score"] == 0 and results["tests"]
    messages, exercise = {}, None
    for line in done.stdout[done.stdout.index("exercise") :].splitlines():
        if re.match(r" +\d+ ", line):
            exercise = int(line.split()[0])
        elif line.strip().startswith("x "):
            messages.setdefault(exercise, []).append(line)
    assert sorted(messages) == sorted(POINTS) and all(
        len(m) == 1 and "not written yet" in m[0] for m in messages.values()
    ), messages


def test_max_scores_add_up_to_each_exercise_points_exactly():
    from course.grade import Check, gradescope, share_points

    for exercise, points in POINTS.items():
        for n in range(1, 10):
            checks = share_points([Check(exercise, f"test_{i}", passed=True) for i in range(n)])
            tests = gradescope(checks, 0)["tests"]
            assert round(sum(t["max_score"] for t in tests) * 100) == points * 100, (exercise, n)
            assert sum(round(t["max_score"] * 100) for t in tests) == points * 100, (exercise, n)


def course_grade(*args, impl, cwd, env=None):
    environ = dict(os.environ, COURSE_IMPL=str(impl), **(env or {}))
    return warm.run(["-m", "course", "grade", *args], cwd=cwd, env=environ)


def test_grade_names_the_exercises_when_there_is_no_such_one(tmp_path):
    missing = max(POINTS) + 1
    done = course_grade("--ex", str(missing), impl=ROOT, cwd=tmp_path)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.strip() == f"no exercise {missing}; exercises are {min(POINTS)}–{max(POINTS)}"
    assert not (tmp_path / "results.json").exists()


def test_a_syntax_error_is_said_once_and_no_pytest_summary_follows_the_table(tmp_path):
    for name in STUDENT_FILES:
        shutil.copy(os.path.join(ROOT, name), tmp_path)
    (tmp_path / "mlp.py").write_text("def broken(:\n")
    done = course_grade("--ex", "1", impl=tmp_path, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stdout[done.stdout.index("exercise") :]
    assert table.count("mlp.py does not import: SyntaxError") == 1, table
    assert re.search(r"\d+ (failed|passed)", done.stdout) is None, done.stdout
    with open(tmp_path / "results.json") as f:
        assert all("mlp.py does not import: SyntaxError" in t["output"] for t in json.load(f)["tests"])
