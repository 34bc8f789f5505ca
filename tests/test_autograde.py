"""Instructors only: `make autograde` end to end, on sample submissions made from the reference.

One run grades five students through nbgrader, every exercise that has a notebook (the
expensive part of the suite, so it runs once, in one test), the four of the course's brief and
one that crashes:
- perfect: the reference, whose code also writes to stderr in the workers, as gloo and torch
  warnings do: nbgrader would zero a test cell with stderr output;
- sums: exercise 4 sums gradients instead of averaging them. It also tries to cheat: a
  conftest.py, its own tests/ and course/ that would pass everything, and a notebook whose test
  cell is emptied and whose extra cell replaces `check`;
- deadlock: exercise 2's ranks wait for a broadcast rank 0 never sends;
- syntax: mlp.py does not parse (mydp.py and sync.py import it: every exercise but 2 and 5 fails);
- crash: building an MLP segfaults, in workers (whose world reports it, with the line); the
  kernel that runs the checks builds none. The checks that build no MLP of the submission still
  pass: those of the wrappers train the tests' own model (tests/helpers.py).
"""

import csv
import json
import os
import subprocess
import sys
import time

import pytest

from course.grade import POINTS
from course.layout import ROOT
from course.make_notebooks import exercise_of, sources
from tests.mutants import make_mutant

# Points lost, by exercise; every other exercise with a notebook scores full marks.
LOST = {
    "perfect": {},
    # start_sync, frozen and the hook's argument pass; the steps and the match with DDP fail
    "sums": {4: 30 - (8 + 4 + 2)},
    "deadlock": {2: 25},
    "syntax": {1: 20, 3: 25, 4: 30, 6: 25, 7: 15, 9: 25},
    "crash": {1: 20, 3: 8, 4: 6},  # only train() builds its MLP: the steps checks train the tests' own model
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
        if grade_id == "ex4_steps":
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


def make_submissions(root):
    warn = "import sys; print('UserWarning: a warning, as gloo prints', file=sys.stderr)\n        "
    make_mutant(root / "perfect", "mlp.py", "sizes = [config.d_in]", warn + "sizes = [config.d_in]")
    sums = make_mutant(root / "sums", "mydp.py", "mean = grad / dist.get_world_size()", "mean = grad.clone()")
    _write(
        os.path.join(sums, "conftest.py"),
        "import pytest\n\n\ndef pytest_runtest_call(item):\n    pytest.skip('free points')\n",
    )
    _write(os.path.join(sums, "tests", "test_ex4_mydp.py"), "def test_everything():\n    pass\n")
    _write(os.path.join(sums, "course", "__init__.py"), "")
    _write(os.path.join(sums, "course", "notebook.py"), "def check(*args):\n    pass\n")
    _cheating_notebook(os.path.join(sums, "exercises", "04_mydp.ipynb"))
    make_mutant(
        root / "deadlock",
        "dist.py",
        "    dist.broadcast(B, src=0)\n",
        "        dist.recv(B, src=0)  # rank 0 never sends\n",
    )
    make_mutant(
        root / "syntax",
        "mlp.py",
        "def split_dataset(X, Y, train_fraction=0.9):",
        "def split_dataset(X, Y, train_fraction=0.9)",
    )
    make_mutant(
        root / "crash",
        "mlp.py",
        "sizes = [config.d_in]",
        "import ctypes; ctypes.string_at(0)  # reads address 0\n        sizes = [config.d_in]",
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


def test_autograde_end_to_end(tmp_path):
    make_submissions(tmp_path / "submissions")
    out = tmp_path / "grading"
    # Short timeouts: the deadlock is caught by the collective timeout, in seconds.
    environ = dict(os.environ, COURSE_COLLECTIVE_TIMEOUT="4", COURSE_TIMEOUT="30")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "course.autograde",
            str(tmp_path / "submissions"),
            "--out",
            str(out),
            "--cell-timeout",
            "60",
        ],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr

    exercises = sorted(exercise_of(path) for path in sources())
    with open(out / "grades.csv") as f:
        rows = {(row["student_id"], row["assignment"]): row for row in csv.DictReader(f)}
    for student, lost in LOST.items():
        scores = tuple(POINTS[n] - lost.get(n, 0) for n in exercises)
        got = tuple(float(rows[student, f"ex{n}"]["score"]) for n in exercises)
        assert got == scores, f"{student}: nbgrader's CSV has {got}, expected {scores}\n{done.stdout}"
        with open(out / "feedback" / student / "results.json") as f:
            results = json.load(f)
        by_exercise = tuple(
            sum(t["score"] for t in results["tests"] if t["name"].startswith(f"Exercise {n}:")) for n in exercises
        )
        assert by_exercise == scores and results["score"] == sum(scores), f"{student}: results.json has {by_exercise}"
        assert all(t["status"] == ("passed" if t["score"] == t["max_score"] else "failed") for t in results["tests"])
        assert (out / "feedback" / student / "feedback.txt").exists()
    assert float(rows["perfect", "ex4"]["max_score"]) == 32, (
        "exercise 4's notebook: 30 autograded points and 2 for the written answer"
    )

    def feedback(student, kind="txt"):
        with open(out / "feedback" / student / f"feedback.{kind}") as f:
            return f.read()

    assert "2.0x the expected average" in feedback("sums")
    assert "Timed out" in feedback("deadlock") or "waited in a collective" in feedback("deadlock"), feedback("deadlock")
    assert "mlp.py does not import: SyntaxError" in feedback("syntax")
    assert "exit code -11" in feedback("crash") and "mlp.py:" in feedback("crash"), feedback("crash")
    with open(out / "autograded" / "sums" / "ex4" / "04_mydp.ipynb") as f:
        graded = json.load(f)["cells"]
    assert "cheat" not in {c["id"] for c in graded}, "a code cell the student added to a notebook was run"
    assert any("".join(c["source"]) == "One all-reduce per parameter." for c in graded), (
        "the student's written answer was not carried over"
    )

    page = feedback("sums", "html")  # nbconvert's page: the failed checks' messages and the written answers
    assert "2.0x the expected average" in page and "ex4_matches_ddp" in page and "One all-reduce per parameter." in page
    assert "<h2" in page and f"Exercise {exercises[-1]}" in page, "a section per exercise"

    deadline = time.monotonic() + 5
    while processes_in(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_in(tmp_path), "autograde left processes behind"


def test_a_check_runs_the_code_outside_the_kernel(tmp_path, monkeypatch):
    """check() runs the submission's code in a process of its own: the kernel's probe finds none of it."""
    from course import impl
    from course.in_notebook import CheckFailed, check, submission_modules
    from tests.test_ex1_mlp import check_layers

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
