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

from course.gradescope import build
from course.layout import SOLUTIONS, STUDENT_FILES

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Gradescope runs Linux")


@pytest.fixture(scope="module")
def autograder(tmp_path_factory):
    """Gradescope's /autograder after setup.sh: the zip of `make gradescope EX=2` unpacked, a venv."""
    root = tmp_path_factory.mktemp("autograder")
    archive = build(str(root / "autograder.zip"), [2])
    with zipfile.ZipFile(archive) as opened:
        opened.extractall(root / "source")
        modes = {info.filename: info.external_attr >> 16 for info in opened.infolist()}
    assert {"setup.sh", "run_autograder", "mlp.py", "tests/test_ex2_dist.py", "course/grade.py"} <= set(modes)
    assert modes["run_autograder"] & 0o111 and modes["setup.sh"] & 0o111, "Gradescope runs them as programs"
    assert "download.pytorch.org/whl/cpu" in (root / "source" / "setup.sh").read_text(), "torch's CPU wheel"
    os.symlink(sys.prefix, root / "venv")
    return root


def run_autograder(root, upload):
    """Put upload ({path: text}) in submission/, run run_autograder; results.json."""
    shutil.rmtree(root / "submission", ignore_errors=True)
    shutil.rmtree(root / "results", ignore_errors=True)
    for path, text in upload.items():
        (root / "submission" / path).parent.mkdir(parents=True, exist_ok=True)
        (root / "submission" / path).write_text(text)
    (root / "submission").mkdir(exist_ok=True)
    script = root / "source" / "run_autograder"
    done = subprocess.run(
        ["bash", str(script)],
        env=dict(os.environ, GRADESCOPE_ROOT=str(root)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    with open(root / "results" / "results.json") as f:
        return json.load(f)


def test_a_nested_upload_of_the_reference_scores_full_marks(autograder):
    upload = {}
    for name in STUDENT_FILES:
        with open(os.path.join(SOLUTIONS, name)) as f:
            upload[f"hw2/code/{name}"] = f.read()
    upload["hw2/dist.py"] = "raise SystemExit('a stray copy: the folder with every file is graded')\n"
    found = run_autograder(autograder, upload)
    assert found["score"] == 25 and all(t["status"] == "passed" for t in found["tests"]), found["output"]
    assert (
        "mlp.py: graded from hw2/code/mlp.py" in found["output"]
        and "dist.py: graded from hw2/code/dist.py" in found["output"]
    )


def test_stubs_with_a_conftest_and_checks_of_their_own_score_0(autograder):
    """Only the student files are taken from an upload: its tests/, course/ and conftest.py are never run."""
    upload = {
        "dist.py": (autograder / "source" / "dist.py").read_text(),
        "conftest.py": "import pytest\n\n\ndef pytest_runtest_call(item):\n    pytest.skip('free points')\n",
        "tests/test_ex2_dist.py": "import pytest\n\n\n@pytest.mark.points(25)\ndef test_by_row():\n    pass\n",
        "course/grade.py": "raise SystemExit(0)\n",
    }
    found = run_autograder(autograder, upload)
    assert found["score"] == 0 and len(found["tests"]) == 8, found["output"]
    assert any("par_matmul_by_row is not written yet" in t["output"] for t in found["tests"])
    assert "mlp.py: not in the submission, graded as the untouched file" in found["output"]
    assert "Submission code ran sandboxed" in found["output"], "COURSE_SANDBOX=required"
