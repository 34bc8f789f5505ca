"""Instructors only: GitHub Classroom's grading workflow (course/instructors/classroom.py), its grade step run
as the workflow runs it, and the exit status for graders that read only that (`--fail-under`).

A stand-in for the runner's workspace: the students' copy checked out as course/ (this
environment as its .venv, which its set-up step would install), and a student's repository as
submission/, holding stubs and a tests/ of its own that passes everything. GitHub's own actions
(checkout, the grading reporter) are not run here; the reporter's input is checked as it reads it.
"""

import base64
import json
import os
import subprocess
import sys

import pytest
import yaml

from course.instructors import classroom
from course.instructors.release import release
from course.layout import SOLUTIONS
from tests import warm


def test_the_workflow_names_the_template_and_grades_with_its_checks():
    text = classroom.workflow("our-org/ddp-course", "v2026", [6, 7])
    steps = yaml.safe_load(text)["jobs"]["run-autograding-tests"]["steps"]
    course = next(s for s in steps if s.get("with", {}).get("path") == "course")
    assert course["with"] == {"repository": "our-org/ddp-course", "ref": "v2026", "path": "course"}
    grade = next(s for s in steps if s.get("id") == "grade")
    assert grade["working-directory"] == "course" and grade["run"].endswith("--github-classroom --ex 6 --ex 7")
    assert 'COURSE_IMPL="$GITHUB_WORKSPACE/submission"' in grade["run"], "the submission's files, the course's checks"
    report = steps[-1]
    assert report["with"]["runners"] == "grade" and "steps.grade.outputs.result" in report["env"]["GRADE_RESULTS"]
    assert report["if"] == "always()", "a grade step that failed (the grader broken) is reported, not skipped"
    assert steps.index(grade) == len(steps) - 2, "the reporter comes right after the grade step"
    assert (
        "ref"
        not in yaml.safe_load(classroom.workflow("our-org/ddp-course"))["jobs"]["run-autograding-tests"]["steps"][1][
            "with"
        ]
    ), "without --ref, the template's default branch"
    with pytest.raises(ValueError, match="OWNER/NAME"):
        classroom.workflow("ddp-course")
    with pytest.raises(ValueError, match="no exercise 99; exercises are 1–"):
        classroom.workflow("our-org/ddp-course", exercises=[6, 99])  # every run would be refused


def grade_step(workspace, exercises, status=0, more=""):
    """Run the workflow's grade step (`more` added to its command) in the stand-in workspace; the
    reporter's input, decoded."""
    grade = next(s for s in steps_of(exercises) if s.get("id") == "grade")
    output = workspace / "github_output"
    output.write_text("")
    environ = dict(os.environ, GITHUB_WORKSPACE=str(workspace), GITHUB_OUTPUT=str(output))
    environ.pop("COURSE_IMPL", None)
    done = subprocess.run(
        ["bash", "-e", "-c", grade["run"] + more],
        cwd=workspace / grade["working-directory"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == status, done.stdout + done.stderr
    (line,) = output.read_text().splitlines()
    key, _, value = line.partition("=")
    assert key == "result"
    with open(workspace / "course" / "results.json") as f:
        return json.loads(base64.b64decode(value)), json.load(f)


def test_the_grade_step_uses_the_courses_checks_not_the_repositorys(tmp_path):
    release(str(tmp_path / "course"))
    os.symlink(sys.prefix, tmp_path / "course" / ".venv")
    release(str(tmp_path / "submission"))  # a student's repository: the template, then their pushes
    cheat = tmp_path / "submission" / "checks" / "test_ex01_mlp.py"
    cheat.write_text("def test_layers(impl_dir):\n    pass\n")
    result, results = grade_step(tmp_path, [1])
    assert result["version"] == 1 and result["status"] == "fail" and result["max_score"] == 20
    assert sum(t["score"] for t in result["tests"]) == results["score"] == 0, result
    assert all("not written yet" in t["message"] for t in result["tests"]), result

    (tmp_path / "submission" / "mlp.py").write_text((open(os.path.join(SOLUTIONS, "mlp.py"))).read())
    result, results = grade_step(tmp_path, [1])
    assert result["status"] == "pass" and sum(t["score"] for t in result["tests"]) == results["score"] == 20, result


def steps_of(exercises):
    """The workflow's steps, as GitHub reads them."""
    return yaml.safe_load(classroom.workflow("our-org/ddp-course", exercises=exercises))["jobs"][
        "run-autograding-tests"
    ]["steps"]


def test_a_grade_step_that_cannot_grade_reports_an_error_with_the_reason(tmp_path):
    """The grader refuses (here: an exercise the course has not, as a workflow edited by hand might
    ask): the step fails, and the reporter, which runs all the same, gets an error that says why,
    never a score of 0 as if earned."""
    release(str(tmp_path / "course"))
    os.symlink(sys.prefix, tmp_path / "course" / ".venv")
    (tmp_path / "submission").mkdir()
    result, results = grade_step(tmp_path, [2], status=2, more=" --ex 99")
    assert result["status"] == "error" and result["max_score"] == 0, result
    (test,) = result["tests"]
    assert test["name"] == "The grader" and test["status"] == "error" and test["score"] == 0, result
    assert "no exercise 99; exercises are 1–" in test["message"] and "could not be graded" in results["output"]


def test_fail_under_sets_the_exit_status_for_graders_that_read_only_that(tmp_path):
    """`python -m course grade --fail-under 100`: 1 short of full marks, 0 at full marks; the table
    and results.json are the same either way."""
    full = warm.grade("--ex", "1", "--fail-under", "100", impl=SOLUTIONS, cwd=tmp_path)
    assert full.returncode == 0 and "20/20" in full.stdout, full.stdout + full.stderr
    stubs = tmp_path / "stubs"
    release(str(stubs))
    short = warm.grade("--ex", "1", "--fail-under", "100", impl=stubs, cwd=tmp_path)
    assert short.returncode == 1 and "Below 100% of the points: exit status 1" in short.stdout, short.stdout
    assert "GRADER ERROR" not in short.stdout
    lenient = warm.grade("--ex", "1", "--fail-under", "0", impl=stubs, cwd=tmp_path)
    assert lenient.returncode == 0, lenient.stdout
