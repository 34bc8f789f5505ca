"""Instructors only: the Gradescope autograder (`make gradescope`), run as Gradescope runs it.

A stand-in for Gradescope's folders (GRADESCOPE_ROOT for /autograder): the zip unpacked into
source/, this environment as venv/ (setup.sh would install it), a submission in submission/, and
run_autograder, the script itself, writing results/results.json. Two uploads: the reference, its
files two folders down; and untouched stubs with files that try to replace the checks (a conftest,
a tests/ and a course/ of their own).
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from course.exercises import STUDENT_FILES
from course.grading import points as checks
from course.instructors import gradescope
from course.instructors.gradescope import RUN, build
from course.layout import SOLUTIONS

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Gradescope runs Linux")


@pytest.fixture(scope="module")
def autograder(tmp_path_factory):
    """Gradescope's /autograder after setup.sh: the zip of `make gradescope EX="2 12"` unpacked, its judge moved
    out of the course (exercise 12's checks draw cases that the reference answers), a venv."""
    root = tmp_path_factory.mktemp("autograder")
    archive = build(str(root / "autograder.zip"), [2, 12])
    with zipfile.ZipFile(archive) as opened:
        opened.extractall(root / "source")
        modes = {info.filename: info.external_attr >> 16 for info in opened.infolist()}
    assert {"setup.sh", "run_autograder", "mlp.py", "checks/test_ex02_dist.py", "course/grading/plugin.py"} <= set(
        modes
    )
    assert modes["run_autograder"] & 0o111 and modes["setup.sh"] & 0o111, "Gradescope runs them as programs"
    assert "download.pytorch.org/whl/cpu" in (root / "source" / "setup.sh").read_text(), "torch's CPU wheel"
    assert {f"judge/{name}" for name in STUDENT_FILES} <= set(modes)
    assert "mv /autograder/source/judge /autograder/judge" in (root / "source" / "setup.sh").read_text()
    shutil.move(root / "source" / "judge", root / "judge")
    os.symlink(sys.prefix, root / "venv")
    return root


def run_autograder(root, upload, script="run_autograder", status=0):
    """Put upload ({path: text}) in submission/, run the script (the zip's run_autograder); results.json."""
    shutil.rmtree(root / "submission", ignore_errors=True)
    shutil.rmtree(root / "results", ignore_errors=True)
    for path, text in upload.items():
        (root / "submission" / path).parent.mkdir(parents=True, exist_ok=True)
        (root / "submission" / path).write_text(text)
    (root / "submission").mkdir(exist_ok=True)
    done = subprocess.run(
        ["bash", str(root / "source" / script)],
        env=dict(os.environ, GRADESCOPE_ROOT=str(root)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == status, done.stdout + done.stderr
    with open(root / "results" / "results.json") as f:
        return json.load(f)


def test_a_nested_upload_of_the_reference_scores_full_marks(autograder):
    upload = {}
    for name in STUDENT_FILES:
        with open(os.path.join(SOLUTIONS, name)) as f:
            upload[f"hw2/code/{name}"] = f.read()
    upload["hw2/dist.py"] = "raise SystemExit('a stray copy: the folder with every file is graded')\n"
    found = run_autograder(autograder, upload)
    # Exercise 12's 20 included: its cases drawn as it grades are answered by the zip's judge.
    assert found["score"] == 25 + 20 and all(t["status"] == "passed" for t in found["tests"]), found["output"]
    assert (
        "mlp.py: graded from hw2/code/mlp.py" in found["output"]
        and "dist.py: graded from hw2/code/dist.py" in found["output"]
    )


def test_stubs_with_a_conftest_and_checks_of_their_own_score_0(autograder):
    """Only the student files are taken from an upload: its tests/, course/ and conftest.py are never run."""
    upload = {
        "dist.py": (autograder / "source" / "dist.py").read_text(),
        "conftest.py": "import pytest\n\n\ndef pytest_runtest_call(item):\n    pytest.skip('free points')\n",
        "checks/test_ex02_dist.py": "import pytest\n\n\n@pytest.mark.points(25)\ndef test_by_row():\n    pass\n",
        "course/grading/plugin.py": "raise SystemExit(0)\n",
    }
    found = run_autograder(autograder, upload)
    graded = [*checks.of_module("checks.test_ex02_dist"), *checks.of_module("checks.test_ex12_cost")]
    assert found["score"] == 0 and len(found["tests"]) == len(graded), found["output"]
    assert any("par_matmul_by_row is not written yet" in t["output"] for t in found["tests"])
    assert "mlp.py: not in the submission, graded as the untouched file" in found["output"]
    assert "Submission code ran sandboxed" in found["output"], "COURSE_SANDBOX=required"


def test_a_run_that_cannot_grade_says_so_in_results_json(autograder):
    """A run_autograder asked for an exercise that is not there (a zip built from another course's
    copy): results.json, where Gradescope reads it, says why, with the upload's notes; no plausible 0."""
    (autograder / "source" / "run_autograder_99").write_text(RUN.format(exercises=" --ex 99"))
    upload = {"hw/dist.py": (autograder / "source" / "dist.py").read_text()}
    found = run_autograder(autograder, upload, "run_autograder_99", status=2)
    assert "could not be graded, so 0 is not its score" in found["output"], found
    assert "no exercise 99; exercises are 1–" in found["output"], "the reason, not a results.json of its own"
    assert "dist.py: graded from hw/dist.py" in found["output"] and "mlp.py: not in the submission" in found["output"]
    assert [t["name"] for t in found["tests"]] == ["The grader"] and found["tests"][0]["max_score"] == 0, found
    assert not (autograder / "source" / "results.json").exists(), "written where Gradescope does not look"


def test_a_grader_that_writes_nothing_leaves_a_results_json_that_says_so(tmp_path, monkeypatch):
    """The grader ended before it wrote results.json (an environment without torch, a crash at start)."""
    (tmp_path / "submission").mkdir()
    monkeypatch.setattr(gradescope.subprocess, "run", lambda command, **_: subprocess.CompletedProcess(command, 2))
    assert gradescope.run(str(tmp_path)) == 2
    with open(tmp_path / "results" / "results.json") as f:
        found = json.load(f)
    assert "could not be graded" in found["output"] and "exit status 2" in found["output"], found
    assert "mlp.py: not in the submission, graded as the untouched file" in found["output"]
    assert [t["max_score"] for t in found["tests"]] == [0], found


def test_the_autograder_refuses_an_exercise_that_does_not_exist(tmp_path, capsys):
    """`make gradescope EX=99`: one line, and no zip whose every run would be refused."""
    assert gradescope.main(["build", str(tmp_path / "autograder.zip"), "--ex", "2", "--ex", "99"]) == 2
    said = capsys.readouterr()
    assert said.out == "" and said.err.splitlines() == [said.err.strip()] and "no exercise 99" in said.err, said
    assert not (tmp_path / "autograder.zip").exists()
