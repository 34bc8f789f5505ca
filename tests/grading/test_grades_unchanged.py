"""Every grade is what it was before the layout changed (issue 46): the same points and the same sentence
for each check, on fixed submissions recorded before the move (grades_before_the_layout.json).

The record holds the reference, the untouched stubs, every TODO answered by `pass`, and two submissions
that each carry one mutant of the mutant tests in every student file they could (the planted texts are in
the record). make test grades one mutant submission here, on the exercises where it loses points; the stubs and `pass` submissions are compared by
the tests that grade them already (test_grading.py), and tools can compare all of them (compare()).
"""

import json
import os
import re

from course.exercises import STUDENT_FILES
from course.layout import SOLUTIONS
from tests import warm
from tests.mutants import plant

RECORD = os.path.join(os.path.dirname(__file__), "grades_before_the_layout.json")
WHOLE_COURSE = 900


def recorded(submission: str) -> dict:
    with open(RECORD) as f:
        return json.load(f)["submissions"][submission]


def _said(text: str) -> str:
    """A sentence as both sides can say it: which of several ranks that do the same (raise, crash) goes first
    is a race, and a failure in a check's own code was placed at the check's line before feedback stopped
    naming the tests' plumbing (issue 49: the record broke on every line moved in a checks module)."""
    text = re.sub(
        r"(?:test_ex\d+_\w+|helpers|contracts)\.py:\d+ in [\w<>]+", "a line of the check's own code, not of yours", text
    )
    return re.sub(r"Rank \d+ of (\d+) ", r"Rank r of \1 ", text)


def exercise_of(name: str) -> int:
    return int(name.split(":")[0].split()[1])  # "Exercise 2: test_by_row[2]"


def compare(found: list, submission: str, exercises: list | None = None) -> list:
    """Each check (of those exercises, or all) whose points or sentence differ from the record, as a line;
    [] when none does."""
    before = {t["name"]: t for t in recorded(submission)["tests"]}
    if exercises is not None:
        before = {name: t for name, t in before.items() if exercise_of(name) in exercises}
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
    """Graded on the exercises where its mutants cost points (in the others it is the reference, whose full
    marks every check of make test shows)."""
    exercises = sorted({exercise_of(t["name"]) for t in recorded("mutants_0")["tests"] if t["status"] != "passed"})
    folder = submission_folder(tmp_path / "submission", "mutants_0")
    done = warm.grade(*(f"--ex={n}" for n in exercises), impl=folder, cwd=tmp_path, timeout=WHOLE_COURSE)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(tmp_path / "results.json") as f:
        found = json.load(f)["tests"]
    differ = compare(found, "mutants_0", exercises)
    assert not differ, "\n".join(differ)
