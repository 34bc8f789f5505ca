"""Every grade is what it was before the layout changed (issue 46): the same points and the same sentence
for each check, on fixed submissions recorded before the move (grades_before_the_layout.json).

The record holds the reference, the untouched stubs, every TODO answered by `pass`, and two submissions
that each carry one mutant of the mutant tests in every student file they could (the planted texts are in
the record). make test grades one mutant submission here; the stubs and `pass` submissions are compared by
the tests that grade them already (test_grading.py), and tools can compare all of them (compare()).
"""

import json
import os
import re

from course.layout import SOLUTIONS, STUDENT_FILES
from tests import warm
from tests.mutants import plant

RECORD = os.path.join(os.path.dirname(__file__), "grades_before_the_layout.json")
WHOLE_COURSE = 900


def recorded(submission: str) -> dict:
    with open(RECORD) as f:
        return json.load(f)["submissions"][submission]


def _said(text: str) -> str:
    """A sentence as both sides can say it: the checks' modules were test_exN_ before the move and
    test_exNN_ after, and which of several ranks that do the same (raise, crash) goes first is a race."""
    text = re.sub(r"test_ex(\d)_", r"test_ex0\1_", text)
    return re.sub(r"Rank \d+ of (\d+) ", r"Rank r of \1 ", text)


def compare(found: list, submission: str) -> list:
    """Each check whose points or sentence differ from the record, as a line; [] when none does."""
    before = {t["name"]: t for t in recorded(submission)["tests"]}
    now = {t["name"]: t for t in found}
    differ = [f"{name}: only {'before' if name in before else 'now'}" for name in sorted(before.keys() ^ now.keys())]
    for name in sorted(before.keys() & now.keys()):
        a, b = before[name], now[name]
        if (a["score"], a["max_score"], a["status"], _said(a["output"])) != (
            b["score"],
            b["max_score"],
            b["status"],
            _said(b["output"]),
        ):
            differ.append(f"{name}: {a['score']}/{a['max_score']} {a['output']!r} -> {b['score']} {b['output']!r}")
    return differ


def submission_folder(dest, submission: str) -> str:
    """The recorded mutant submission, planted anew from solutions/."""
    os.makedirs(dest, exist_ok=True)
    for name in STUDENT_FILES:
        with open(os.path.join(SOLUTIONS, name)) as f, open(os.path.join(dest, name), "w") as out:
            out.write(f.read())
    for file, (_, old, new) in recorded(submission)["planted"].items():
        plant(dest, file, old, new)
    return str(dest)


def test_a_mutant_submission_keeps_every_points_and_sentence(tmp_path):
    folder = submission_folder(tmp_path / "submission", "mutants_0")
    done = warm.grade(impl=folder, cwd=tmp_path, timeout=WHOLE_COURSE)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(tmp_path / "results.json") as f:
        found = json.load(f)["tests"]
    assert not compare(found, "mutants_0"), "\n".join(compare(found, "mutants_0"))
