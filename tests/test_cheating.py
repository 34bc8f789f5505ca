"""Submissions that try to change their own grade, and gain nothing.

Each test grades a copy of the grader (course/ and tests/, so a cheat that edits them cannot
damage this repository) on a submission: the untouched student files with a few lines of cheat
added, where the cheat attacks the grading process; a submission that solves nothing must still
score 0, the grader must still write a valid results.json, and its feedback says what happened
where it can. Exercise 2 only: its four checks are the quickest.
"""

import json
import os
import re
import shutil
import time

from course.grade import POINTS
from course.student import ROOT, SOLUTIONS, STUDENT_FILES
from tests import warm


def grade(tmp_path, cheats, base=ROOT, ex=2):
    """Grade, in a copy of the grader, the files of `base` with each cheat appended to its file."""
    grader, submission = tmp_path / "grader", tmp_path / "submission"
    for folder in ("course", "tests"):
        shutil.copytree(os.path.join(ROOT, folder), grader / folder, ignore=shutil.ignore_patterns("__pycache__"))
    submission.mkdir()
    for name in STUDENT_FILES:
        shutil.copy(os.path.join(base, name), submission)
    for name, text in cheats.items():
        with open(submission / name, "a") as f:
            f.write("\n" + text)
    done = warm.run(
        ["-m", "course", "grade", *(["--ex", str(ex)] if ex else [])],
        cwd=grader,
        env=dict(os.environ, COURSE_IMPL=str(submission)),
    )
    return done, grader / "results.json"


def results(path):
    with open(path) as f:
        found = json.load(f)
    assert {"score", "tests", "output"} <= found.keys()
    return found


def assert_no_points(done, path, said=""):
    """0 points, a valid results.json, every check failed, and `said` in their feedback."""
    assert done.returncode == 0, done.stdout + done.stderr
    found = results(path)
    assert found["score"] == 0 and [t["status"] for t in found["tests"]] == ["failed"] * 4, found
    assert sum(t["max_score"] for t in found["tests"]) == POINTS[2]
    assert re.search(said, " ".join(t["output"] for t in found["tests"])), found["tests"][0]["output"]
    assert "25/25" not in done.stdout and "0/25" in done.stdout, done.stdout
    return found


# The cheat of issue 14: before, exercise 2 scored 25/25 with dist.py untouched.
ISSUE_14 = """
import sys as _sys
for _name, _mod in list(_sys.modules.items()):
    if _name.startswith("tests.test_ex"):
        for _k in dir(_mod):
            if _k.startswith("check_"):
                setattr(_mod, _k, lambda *a, **k: None)
"""

PATCH_GRADER = """
import course.grade as _grade
_grade.POINTS[2] = 1000
_grade.Check.score = property(lambda self: self.max_score)
_grade.explain = lambda error: ""
_grade._Grader.pytest_runtest_logreport = lambda self, report: None
"""

# Wrong numbers of the right shape, and torch's comparisons told to say they are equal.
PATCH_TORCH = """
import torch
import torch.distributed as dist
torch.allclose = lambda *a, **k: True
torch.equal = lambda *a, **k: True


def _product_shape(A, B):
    shape = torch.tensor([A.shape[0], B.shape[1]] if dist.get_rank() == 0 else [0, 0])
    dist.broadcast(shape, src=0)
    return tuple(shape.tolist())


def par_matmul_by_row(A, B):
    shape = _product_shape(A, B)
    return torch.zeros(shape) if dist.get_rank() == 0 else None


def par_matmul_by_reduction(A, B):
    return torch.zeros(_product_shape(A, B))
"""

FAKE_RESULTS = {"score": 160, "execution_time": 1, "output": "", "tests": []}
WRITE_RESULTS = f"""
import json as _json, os as _os
with open(_os.path.join(_os.getcwd(), "results.json"), "w") as _f:
    _json.dump({FAKE_RESULTS!r}, _f)
"""

# A process of its own, in a session of its own, that writes results.json every 0.1 s for a minute.
DAEMON_WRITER = f"""
import json, time
for _ in range(600):  # a minute: longer than any grading run
    time.sleep(0.1)
    with open("results.json", "w") as f:
        json.dump({FAKE_RESULTS!r}, f)
"""
RESULTS_DAEMON = f"""
import subprocess as _sp, sys as _sys
_sp.Popen([_sys.executable, "-c", {DAEMON_WRITER!r}], start_new_session=True, stdin=_sp.DEVNULL, stdout=_sp.DEVNULL, stderr=_sp.DEVNULL)
"""

EXIT_0 = "import os as _os\n_os._exit(0)\n"

KILL_GRADER = "import os as _os, signal as _signal\n_os.kill(_os.getppid(), _signal.SIGKILL)\n"

FAKE_TABLE = """
import os as _os, sys as _sys
_table = "exercise   checks       points\\n       2      4/4        25/25\\n   total      4/4        25/25\\n"
print(_table)
_os.write(1, _table.encode())
_sys.__stderr__.write(_table)
"""

EDIT_CHECKS = """
import os as _os
from course.student import ROOT as _ROOT
with open(_os.path.join(_ROOT, "tests", "test_ex2_dist.py"), "a") as _f:
    _f.write("\\n# a submission was here\\n")
"""

# A result whose unpickling runs code in the process that receives it.
EVIL_RESULT = """
class _Verdict:
    def __reduce__(self):
        return (exec, ("import course.grade as g; g.Check.passed = property(lambda s: True, lambda s, v: None)",))


def par_matmul_by_row(A, B):
    return _Verdict()


def par_matmul_by_reduction(A, B):
    return _Verdict()
"""


def test_the_cheat_of_issue_14_gains_nothing(tmp_path):
    assert_no_points(*grade(tmp_path, {"mlp.py": ISSUE_14}), "par_matmul_by_row is not written yet")


def test_patching_the_grader_plugin_and_its_points_gains_nothing(tmp_path):
    assert_no_points(*grade(tmp_path, {"mlp.py": PATCH_GRADER}), "par_matmul_by_row is not written yet")


def test_patching_torch_comparisons_gains_nothing(tmp_path):
    assert_no_points(*grade(tmp_path, {"dist.py": PATCH_TORCH}), "returned wrong numbers")


def test_writing_results_json_gains_nothing(tmp_path):
    done, path = grade(tmp_path, {"mlp.py": WRITE_RESULTS})
    assert_no_points(done, path, "par_matmul_by_row is not written yet")


def test_a_daemon_writing_results_json_gains_nothing(tmp_path):
    done, path = grade(tmp_path, {"mlp.py": RESULTS_DAEMON})
    time.sleep(1.0)  # the daemon, had it survived the grader, has written by now: it writes every 0.1 s
    assert_no_points(done, path, "par_matmul_by_row is not written yet")


def test_a_worker_that_exits_0_without_a_result_gains_nothing(tmp_path):
    assert_no_points(*grade(tmp_path, {"mlp.py": EXIT_0}), r"exit code 0|result")


def test_killing_the_grader_gains_nothing(tmp_path):
    """The grade is then missing, not higher (the README says so)."""
    done, path = grade(tmp_path, {"mlp.py": KILL_GRADER})
    assert done.returncode != 0
    assert not path.exists() or results(path)["score"] == 0


def test_printing_a_fake_table_gains_nothing(tmp_path):
    done, path = grade(tmp_path, {"mlp.py": FAKE_TABLE})
    assert_no_points(done, path, "par_matmul_by_row is not written yet")
    assert done.stdout.count("exercise   checks") == 1, done.stdout


def test_editing_the_checks_on_disk_fails_everything(tmp_path):
    """The reference itself, with the edit: it would score 25/25 without the fingerprint."""
    done, path = grade(tmp_path, {"mlp.py": EDIT_CHECKS}, base=SOLUTIONS)
    assert_no_points(done, path, r"the grader's own files changed while it ran \(tests/test_ex2_dist.py\)")


def test_a_result_that_runs_code_when_unpickled_gains_nothing(tmp_path):
    assert_no_points(*grade(tmp_path, {"dist.py": EVIL_RESULT}))


def test_the_reference_scores_full_marks(tmp_path):
    """The control of the cheats above: the same grader, in the same copy, gives honest code exercise 2's
    points. (Every exercise's checks pass on the reference in the suite's own test_exN_*.py.)"""
    done, path = grade(tmp_path, {}, base=SOLUTIONS)
    assert done.returncode == 0, done.stdout + done.stderr
    found = results(path)
    assert found["score"] == POINTS[2] and all(t["status"] == "passed" for t in found["tests"]), done.stdout
