"""GitHub Classroom's grading workflow: ``python -m course.instructors.classroom DEST --template OWNER/NAME [--ex N ...]``.

Writes DEST/.github/workflows/classroom.yml into a students' copy (``make release``) that becomes
the assignment's template repository. On each push to a student's repository the workflow

- checks out the student's repository (the submission) and, beside it, the template at the
  commit named by ``--ref`` (default: its default branch): the course's own checks and package,
  never the ``checks/`` or ``course/`` of the student's repository, which the student may edit;
- installs torch's CPU wheel and the course's requirements;
- grades the submission's student files with the template's checks (``python -m course grade
  --github-classroom``), which gives GitHub Classroom's grading reporter every check with its
  points (the step's output ``result``), so a student gets partial credit, check by check.

What a grade made this way is worth: the workflow runs in the student's own repository, so a
student who edits the workflow file can change what it reports. Mark ``.github/**`` as a
protected path in the assignment (GitHub Classroom then flags a repository whose workflow
changed), and use Gradescope or ``make autograde`` where the grade counts (docs/classroom.md).
"""

from __future__ import annotations

import argparse
import os
import sys

WORKFLOW = """\
# GitHub Classroom's autograding for the course (written by `python -m course.instructors.classroom`).
# The checks come from the template repository, not from this one: see docs/classroom.md.
name: Autograding Tests
"on": [push, repository_dispatch, workflow_dispatch]
permissions:
  checks: write
  actions: read
  contents: read
jobs:
  run-autograding-tests:
    runs-on: ubuntu-latest
    if: github.actor != 'github-classroom[bot]'
    timeout-minutes: 20
    steps:
      - name: The submission (this repository)
        uses: actions/checkout@v4
        with:
          path: submission
      - name: The course's checks (the template repository)
        uses: actions/checkout@v4
        with:
          repository: @TEMPLATE@
          ref: @REF@
          path: course
      - uses: actions/setup-python@v5
        with:
          python-version: "3.11"
      - name: Set up (torch's CPU wheel; PyPI's Linux wheel brings several GB of CUDA)
        working-directory: course
        run: |
          python3 -m venv .venv
          .venv/bin/pip install --quiet --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
          python3 -m course setup
      - name: Grade
        id: grade
        working-directory: course
        run: COURSE_IMPL="$GITHUB_WORKSPACE/submission" .venv/bin/python -m course grade --github-classroom@EXERCISES@
      # Also when the grade step failed: a grader that could not grade says why (its result is an error).
      - name: Report
        if: always()
        uses: classroom-resources/autograding-grading-reporter@v1
        env:
          GRADE_RESULTS: "${{ steps.grade.outputs.result }}"
        with:
          runners: grade
"""


def workflow(template: str, ref: str = "", exercises: list | None = None) -> str:
    """The workflow's text for the template repository ``template`` (OWNER/NAME) at ``ref``."""
    from course.grading.results import no_such_exercise

    if template.count("/") != 1 or not all(template.split("/")):
        raise ValueError(f"--template is the template repository as OWNER/NAME, not {template!r}")
    problem = no_such_exercise(exercises)
    if problem:
        raise ValueError(problem)
    chosen = "".join(f" --ex {n}" for n in exercises or [])
    text = WORKFLOW.replace("@TEMPLATE@", template).replace("@EXERCISES@", chosen)
    if ref:
        return text.replace("@REF@", ref)
    return text.replace("          ref: @REF@\n", "")


def write(dest: str, template: str, ref: str = "", exercises: list | None = None) -> str:
    """Write the workflow into the copy at dest; return its path."""
    text = workflow(template, ref, exercises)
    path = os.path.join(dest, ".github", "workflows", "classroom.yml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course.instructors.classroom", description=__doc__.splitlines()[0])
    parser.add_argument("dest", help="the students' copy (make release DEST=...) that becomes the template")
    parser.add_argument("--template", required=True, help="the template repository on GitHub, OWNER/NAME")
    parser.add_argument(
        "--ref", default="", help="its branch, tag or commit whose checks grade (default: its default branch)"
    )
    parser.add_argument("--ex", type=int, action="append", help="grade only this exercise (again for more)")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {write(args.dest, args.template, args.ref, args.ex)}")
    except ValueError as refused:
        print(refused, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
