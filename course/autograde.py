"""Grade a folder of submissions through nbgrader: ``python -m course.autograde SUBMISSIONS --out DIR``.

SUBMISSIONS holds one folder per student: their mlp.py, dist.py and mydp.py, and their exercise
notebooks if they have any. Each exercise N is the nbgrader assignment exN, made from the
notebook sources in solutions/notebooks/.

Only the students' own work is graded, and only by the instructor's checks:
- The three .py files, and nothing else, are copied into a clean folder that COURSE_IMPL names
  for the kernels: a student's tests, conftest.py or module named like a support module is never
  seen. The notebooks' cells import the checks from this repository's tests/.
- The notebook graded is this release's, with the student's written answers copied into it by
  nbgrader cell id: code a student adds to a notebook does not run. Neither do the demo cells:
  they earn no points, and a slow or hanging demo would only delay grading (tests/test_grading.py
  runs them). (nbgrader copies an
  assignment's non-notebook source files over a submission; the sources here have none, so the
  students' .py files are the ones graded.)
- Each notebook runs in its own kernel process, and each cell has a wall-clock limit
  (--cell-timeout); every world of workers has its own (COURSE_TIMEOUT,
  COURSE_COLLECTIVE_TIMEOUT). A submission that hangs, crashes or does not import scores 0 on the
  checks it fails, with the reason; its other exercises, and the other students, are graded.

DIR receives nbgrader's course folder (gradebook.db, source/, release/, submitted/, autograded/),
grades.csv (nbgrader's CSV export) and, per student, feedback/STUDENT/feedback.txt (the table
`make grade` prints) and feedback/STUDENT/results.json (Gradescope's format).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import re
import shutil
import sys
import time
import warnings

# jsonschema's optional IRI format checker builds a grammar for seconds whenever nbformat is
# imported; notebooks never need it.
sys.modules.setdefault("rfc3987_syntax", None)

from course import env  # noqa: E402
from course.grade import Check, table, write_results  # noqa: E402
from course.notebooks import dumps, exercise_of, notebook, sources  # noqa: E402
from course.student import STUDENT_FILES  # noqa: E402


def _gradebook_version() -> str:
    """The schema version nbgrader stamps on a new gradebook.

    nbgrader asks a new `alembic heads` process, which imports nbgrader again: 5 to 10 s here.
    Asking alembic in this process takes milliseconds and gives the same answer.
    """
    from alembic.script import ScriptDirectory
    from nbgrader.dbutil import ALEMBIC_DIR

    return ScriptDirectory(ALEMBIC_DIR).get_current_head()


def _nbgrader_config(out: str, cell_timeout: int):
    from traitlets.config import Config

    config = Config()
    config.CourseDirectory.root = out
    config.Execute.timeout = cell_timeout
    config.Execute.error_on_timeout = {
        "ename": "CellTimeoutError",
        "evalue": f"still running after {cell_timeout} s: a hang that the launcher's own timeouts did not stop",
        "traceback": [],
    }
    return config


def _run(app_class, config, assignment: str, student: str = ".") -> str:
    """Run one nbgrader converter; return '' or the last error it logged."""
    from nbgrader.converters.base import NbGraderException
    from nbgrader.coursedir import CourseDirectory

    errors: list = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())
    coursedir = CourseDirectory(config=config, assignment_id=assignment, student_id=student)
    app = app_class(coursedir=coursedir, config=config)
    app.log.addHandler(handler)
    try:
        app.start()
    except NbGraderException:
        tracebacks = [e for e in errors if e.startswith("Traceback")]
        last = (tracebacks or errors or ["nbgrader failed"])[-1].strip().splitlines()[-1]
        return re.sub(r"^[\w.]+\.(\w+: )", r"\1", last)  # DeadKernelError: ..., without its module
    finally:
        app.log.removeHandler(handler)
    return ""


def make_assignments(out: str, config) -> dict:
    """Write each exercise's instructor notebook to source/exN/ and let nbgrader release it."""
    from nbgrader.converters import GenerateAssignment

    assignments = {}
    for path in sources():
        name = f"ex{exercise_of(path)}"
        os.makedirs(os.path.join(out, "source", name), exist_ok=True)
        with open(os.path.join(out, "source", name, os.path.basename(path)[: -len(".md")] + ".ipynb"), "w") as f:
            f.write(dumps(notebook(path, solutions=True)))
        error = _run(GenerateAssignment, config, name)
        if error:
            raise RuntimeError(f"nbgrader could not make assignment {name}: {error}")
        assignments[name] = os.path.basename(path)[: -len(".md")]
    return assignments


def _answers(submission: str, stem: str) -> dict:
    """The student's written answers in their copy of a notebook, by nbgrader cell id."""
    for where in (submission, os.path.join(submission, "exercises")):
        path = os.path.join(where, stem + ".ipynb")
        if os.path.isfile(path) and not os.path.islink(path):
            try:
                with open(path) as f:
                    cells = json.load(f)["cells"]
            except (ValueError, KeyError, TypeError):
                return {}
            return {
                c["metadata"]["nbgrader"]["grade_id"]: c["source"]
                for c in cells
                if isinstance(c, dict) and c.get("metadata", {}).get("nbgrader", {}).get("solution")
            }
    return {}


def take_in(submission: str, student: str, out: str, assignments: dict) -> str:
    """Copy what is graded of one submission into the course folder; return the code folder."""
    code = os.path.join(out, "code", student)
    shutil.rmtree(code, ignore_errors=True)
    os.makedirs(code)
    for name in STUDENT_FILES:
        path = os.path.join(submission, name)
        if os.path.isfile(path) and not os.path.islink(path):
            shutil.copyfile(path, os.path.join(code, name))
    for assignment, stem in assignments.items():
        with open(os.path.join(out, "release", assignment, stem + ".ipynb")) as f:
            nb = json.load(f)
        answers = _answers(submission, stem)
        nb["cells"] = [c for c in nb["cells"] if "demo" not in c["metadata"].get("tags", [])]
        for cell in nb["cells"]:
            grading = cell["metadata"].get("nbgrader", {})
            if grading.get("solution") and isinstance(answers.get(grading["grade_id"]), (str, list)):
                cell["source"] = answers[grading["grade_id"]]
        folder = os.path.join(out, "submitted", student, assignment)
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        with open(os.path.join(folder, stem + ".ipynb"), "w") as f:
            f.write(dumps(nb))
    return code


def _reason(cell: dict) -> str:
    """What a graded cell's outputs say went wrong ('' when nothing did)."""
    for output in cell.get("outputs", []):
        if output["output_type"] == "error":
            if output["ename"] == "CheckFailed":
                return output["evalue"]
            if output["ename"] == "KeyboardInterrupt":  # nbclient interrupts a cell at its time limit
                return "still running at the cell's time limit (--cell-timeout): an endless loop, or a wait that never ends?"
            return f"{output['ename']}: {output['evalue']}".rstrip(": ")
        if output["output_type"] == "stream" and output["name"] == "stderr":
            return "the cell wrote to stderr: " + "".join(output["text"]).strip().splitlines()[0]
    return ""


def _notebook(out: str, step: str, student: str, assignment: str, stem: str) -> list:
    path = os.path.join(out, step, student, assignment, stem + ".ipynb")
    if not os.path.exists(path):  # nbgrader removes a notebook it failed to grade
        return []
    with open(path) as f:
        return json.load(f)["cells"]


def collect(out: str, student: str, assignments: dict, failures: dict) -> list:
    """The student's checks: scores from nbgrader's gradebook, reasons from the graded notebooks."""
    from nbgrader.api import Gradebook, MissingEntry

    checks = []
    with Gradebook(f"sqlite:///{os.path.join(out, 'gradebook.db')}") as gradebook:
        for assignment, stem in assignments.items():
            graded = {c["metadata"]["nbgrader"]["grade_id"]: c for c in _notebook(out, "autograded", student, assignment, stem) if "nbgrader" in c["metadata"]}
            try:
                grades = {g.name: g for g in gradebook.find_submission_notebook(stem, assignment, student).grades}
            except MissingEntry:
                grades = {}
            for cell in _notebook(out, "release", ".", assignment, stem):
                grading = cell["metadata"].get("nbgrader", {})
                if not grading.get("grade") or grading.get("solution"):  # written answers are graded by hand
                    continue
                grade = grades.get(grading["grade_id"])
                if grade is not None and assignment in failures:  # nbgrader recorded nothing for it
                    grade.auto_score, grade.needs_manual_grade = 0.0, False
                passed = grade is not None and (grade.auto_score or 0.0) >= grading["points"]
                reason = failures.get(assignment) or _reason(graded.get(grading["grade_id"], {})) or "no points"
                checks.append(Check(int(assignment[2:]), grading["grade_id"], passed, "" if passed else reason, grading["points"]))
        gradebook.db.commit()
    return checks


def export_csv(out: str) -> str:
    from nbgrader.api import Gradebook
    from nbgrader.plugins import CsvExportPlugin

    path = os.path.join(out, "grades.csv")
    with Gradebook(f"sqlite:///{os.path.join(out, 'gradebook.db')}") as gradebook:
        CsvExportPlugin(to=path).export(gradebook)
    return path


def grade_all(submissions: str, out: str, cell_timeout: int) -> dict:
    """Grade every student's folder in submissions; return their checks by student."""
    from nbgrader.converters import Autograde

    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    config = _nbgrader_config(out, cell_timeout)
    assignments = make_assignments(out, config)
    students = sorted(d for d in os.listdir(submissions) if os.path.isdir(os.path.join(submissions, d)) and not d.startswith("."))
    results = {}
    for student in students:
        started = time.monotonic()
        os.environ["COURSE_IMPL"] = take_in(os.path.join(submissions, student), student, out, assignments)
        failures = {}
        for assignment in assignments:
            error = _run(Autograde, config, assignment, student)
            if error:
                failures[assignment] = f"the notebook could not be graded: {error}"
        checks = collect(out, student, assignments, failures)
        feedback = os.path.join(out, "feedback", student)
        os.makedirs(feedback, exist_ok=True)
        write_results(os.path.join(feedback, "results.json"), checks, time.monotonic() - started)
        with open(os.path.join(feedback, "feedback.txt"), "w") as f:
            f.write(f"Autograded checks of {student} (written answers are graded by hand):\n\n{table(checks)}\n")
        results[student] = checks
        print(f"{student}: {sum(c.score for c in checks):g}/{sum(c.max_score for c in checks):g} in {time.monotonic() - started:.1f} s", flush=True)
    export_csv(out)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("submissions", help="a folder with one folder per student")
    parser.add_argument("--out", default="grading", help="nbgrader's course folder and the grades (default: grading)")
    parser.add_argument("--cell-timeout", type=int, default=300, help="seconds one notebook cell may run")
    args = parser.parse_args(argv)
    os.environ.update(env.check_settings())
    warnings.filterwarnings("ignore", module=r"nbgrader\.")  # its own SQLAlchemy session warnings
    import nbgrader.api

    nbgrader.api.get_alembic_version = _gradebook_version
    if sys.platform.startswith("linux"):  # kernels forked from a server that imported torch once (course/kernels.py)
        os.environ.setdefault("JUPYTER_DEFAULT_PROVISIONER_NAME", "course-forked")
    try:
        grade_all(args.submissions, args.out, args.cell_timeout)
    finally:
        for process in mp.active_children():  # a kernel nbgrader did not stop
            process.kill()
    print(f"grades: {os.path.join(args.out, 'grades.csv')}; feedback: {os.path.join(args.out, 'feedback')}/STUDENT/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
