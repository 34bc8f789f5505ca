"""Grade a folder of submissions through nbgrader: ``python -m course.instructors.autograde SUBMISSIONS --out DIR``.

SUBMISSIONS holds one folder per student: their student files (course/layout.py) and their
exercise notebooks if they have any. Each exercise N is the nbgrader assignment exN, made from the
notebook sources in solutions/notebooks/; every exercise that `make grade` grades has one, or
autograding stops before it starts.

Only the students' own work is graded, and only by the instructor's checks:
- The student files, and nothing else, are copied into a clean folder that COURSE_IMPL names
  for the kernels: a student's tests, conftest.py or module named like a support module is never
  seen. The notebooks' cells import the checks from this repository's checks/.
- The notebook graded is this release's, with the student's written answers copied into it by
  nbgrader cell id: code a student adds to a notebook does not run. Neither do the demo cells:
  they run the student's code in the kernel, earn no points, and a slow or hanging demo would
  only delay grading (tests/grading/test_grading.py runs them). (nbgrader copies an assignment's
  non-notebook source files over a submission; the sources here have none, so the students'
  files are the ones graded.)
- Kernels run the cells of the notebooks (execute()), --jobs at a time, each student's notebooks
  shared among --jobs kernels. A kernel never holds the submission's code: each check runs it
  in processes of its own, and a probe after the last cell proves it (else that student's notebooks
  are not graded, with the reason). Each cell has a wall-clock limit
  (--cell-timeout); every world of workers has its own (COURSE_TIMEOUT,
  COURSE_COLLECTIVE_TIMEOUT). A submission that hangs, crashes or does not import scores 0 on the
  checks it fails, with the reason; its other exercises, and the other students, are graded.
- nbgrader then records the grades of the executed notebooks (its autograde step, without
  executing them again) in its gradebook, as it would for notebooks it ran itself.

DIR receives nbgrader's course folder (gradebook.db, source/, release/, submitted/, autograded/),
grades.csv (nbgrader's CSV export) and, per student, in feedback/STUDENT/: feedback.txt (the table
`make grade` prints), feedback.html (each check with its points and what it found, and the
written answers), results.json (Gradescope's format) and output.txt (what the student's code
printed while its checks ran; on Linux, where kernels are forked, none of it reaches the terminal); and the class report, report.html and
report.json (course/instructors/report.py), from every failed check's facts: each check that fails in a
notebook shows them as an output of type course.grading.plugin.CASES_MIME, which collect() reads.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import dataclasses
import html
import json
import logging
import multiprocessing as mp
import os
import re
import shutil
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

# jsonschema's optional IRI format checker builds a grammar for seconds whenever nbformat is
# imported; notebooks never need it.
sys.modules.setdefault("rfc3987_syntax", None)

from course.exercises import STUDENT_FILES, by_number  # noqa: E402
from course.grading.results import CASES_MIME, Check, table, write_results  # noqa: E402
from course.instructors import report  # noqa: E402
from course.instructors.make_notebooks import dumps, exercise_of, notebook, sources  # noqa: E402
from course.layout import ROOT, graded_exercises  # noqa: E402
from course.runtime import env, sandbox  # noqa: E402


def _gradebook_version() -> str:
    """The schema version nbgrader stamps on a new gradebook.

    nbgrader asks a new `alembic heads` process, which imports nbgrader again: 5 to 10 s here.
    Asking alembic in this process takes milliseconds and gives the same answer.
    """
    from alembic.script import ScriptDirectory
    from nbgrader.dbutil import ALEMBIC_DIR

    return ScriptDirectory(ALEMBIC_DIR).get_current_head()


def _nbgrader_config(out: str):
    """nbgrader records the grades of notebooks that execute() has run: it neither clears nor runs them."""
    from nbgrader.converters import Autograde
    from nbgrader.preprocessors import ClearOutput, Execute
    from traitlets.config import Config

    config = Config()
    config.CourseDirectory.root = out
    config.Autograde.sanitize_preprocessors = [
        p for p in Autograde.class_traits()["sanitize_preprocessors"].default() if p is not ClearOutput
    ]
    config.Autograde.autograde_preprocessors = [
        p for p in Autograde.class_traits()["autograde_preprocessors"].default() if p is not Execute
    ]
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


def make_assignments(out: str, config, exercises: list | None = None) -> dict:
    """Write each exercise's instructor notebook to source/exN/ and let nbgrader release it; all
    exercises, or those in `exercises`."""
    from nbgrader.converters import GenerateAssignment

    missing = sorted(set(graded_exercises()) - {exercise_of(path) for path in sources()})
    if missing:
        raise RuntimeError(
            f"exercises {missing} have checks but no notebook in solutions/notebooks/: autograding would leave them out"
        )
    unknown = sorted(set(exercises or []) - set(graded_exercises()))
    if unknown:
        raise RuntimeError(f"no exercise {unknown}; exercises are {graded_exercises()}")
    assignments = {}
    for path in sources():
        if exercises and exercise_of(path) not in exercises:
            continue
        name = f"ex{exercise_of(path)}"
        os.makedirs(os.path.join(out, "source", name), exist_ok=True)
        with open(os.path.join(out, "source", name, os.path.basename(path)[: -len(".md")] + ".ipynb"), "w") as f:
            f.write(dumps(notebook(path, solutions=True)))
        error = _run(GenerateAssignment, config, name)
        if error:
            raise RuntimeError(f"nbgrader could not make assignment {name}: {error}")
        assignments[name] = os.path.basename(path)[: -len(".md")]
    return assignments


def _text(source) -> str | None:
    """A cell's source as nbformat keeps it (a string, or a list of strings), else None."""
    if isinstance(source, str):
        return source
    if isinstance(source, list) and all(isinstance(line, str) for line in source):
        return "".join(source)
    return None


def _answers(submission: str, stem: str) -> tuple:
    """The student's written answers in their copy of a notebook, by nbgrader cell id, and what
    could not be read of it ('' when nothing): a notebook that is not one costs its answers only."""
    for where in (submission, os.path.join(submission, "exercises")):
        path = os.path.join(where, stem + ".ipynb")
        if os.path.isfile(path) and not os.path.islink(path):
            try:
                with open(path, encoding="utf-8") as f:
                    cells = json.load(f)["cells"]
                found = {
                    c["metadata"]["nbgrader"]["grade_id"]: _text(c.get("source"))
                    for c in cells
                    if isinstance(c, dict) and c.get("metadata", {}).get("nbgrader", {}).get("solution")
                }
            except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
                return {}, f"{stem}.ipynb could not be read ({type(error).__name__}): its written answers are empty"
            unreadable = sorted(str(grade_id) for grade_id, text in found.items() if text is None)
            problem = f"{stem}.ipynb: the answers {unreadable} are not text: left empty" if unreadable else ""
            return {grade_id: text for grade_id, text in found.items() if text is not None}, problem
    return {}, ""


def take_in(submission: str, student: str, out: str, assignments: dict) -> tuple:
    """Copy what is graded of one submission into the course folder; return the code folder and
    what of the submission could not be read, one sentence each."""
    code = os.path.join(out, "code", student)
    shutil.rmtree(code, ignore_errors=True)
    os.makedirs(code)
    for name in STUDENT_FILES:
        path = os.path.join(submission, name)
        if os.path.isfile(path) and not os.path.islink(path):
            shutil.copyfile(path, os.path.join(code, name))
    problems = []
    for assignment, stem in assignments.items():
        with open(os.path.join(out, "release", assignment, stem + ".ipynb")) as f:
            nb = json.load(f)
        answers, problem = _answers(submission, stem)
        problems += [problem] if problem else []
        nb["cells"] = [c for c in nb["cells"] if "demo" not in c["metadata"].get("tags", [])]
        for cell in nb["cells"]:
            grading = cell["metadata"].get("nbgrader", {})
            if grading.get("solution") and grading["grade_id"] in answers:
                cell["source"] = answers[grading["grade_id"]]
        folder = os.path.join(out, "submitted", student, assignment)
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        with open(os.path.join(folder, stem + ".ipynb"), "w") as f:
            f.write(dumps(nb))
    return code, problems


# Run after the graded cells, in the same kernel: what it holds of the submission's own code, shown
# as data of a type of its own. Never printed: a worker can write into the kernel's output streams
# (a descriptor it kept, a timer), whereas display data comes from the kernel's own process only.
PROBE_MIME = "application/vnd.ddp-course.held+json"
_PROBE = (
    "import os\nfrom IPython.display import display\nfrom course.grading.in_notebook import submission_modules\n"
    f"display({{{PROBE_MIME!r}: submission_modules(os.environ['COURSE_IMPL'])}}, raw=True)"
)


def _probe_failure(probe) -> str:
    """Why the kernel's probe does not prove that it held none of the submission's code ('' when it does)."""
    shown = [
        output["data"][PROBE_MIME]
        for output in probe.outputs
        if output.get("output_type") == "display_data" and PROBE_MIME in output.get("data", {})
    ]
    if len(shown) != 1 or not isinstance(shown[0], list) or not all(isinstance(name, str) for name in shown[0]):
        said = sorted({str(output.get("ename") or output.get("output_type")) for output in probe.outputs})
        return f"the kernel that ran its checks could not be probed (it showed {said}): its results cannot be trusted"
    if shown[0]:
        return f"the kernel that ran its checks held the submission's code ({', '.join(shown[0])}): its results cannot be trusted"
    return ""


def output_file(out: str, student: str) -> str:
    """What a student's code printed while its checks ran, and the library lines it caused."""
    return os.path.join(out, "feedback", student, "output.txt")


def _not_graded(cells: list, reason: str) -> None:
    """The cells' outputs become the reason they are not graded (none, when reason is '')."""
    import nbformat

    if not reason:
        return
    for cell in cells:
        cell.outputs = [
            nbformat.v4.new_output(
                "error", ename="NotGraded", evalue=f"the notebook could not be graded: {reason}", traceback=[]
            )
        ]


async def execute(out: str, student: str, assignments: dict, code: str, cell_timeout: int) -> float:
    """Run the code cells of a student's notebooks in `assignments`, all in one kernel; save their outputs in place.

    The cells are this repository's (take_in keeps only the written answers of a submission), so
    their outputs, which nbgrader then grades, are the checks' own. One kernel serves several
    notebooks: a kernel is started once, not once per exercise. It never holds the
    submission's code: each check runs it in processes of its own (course.grading.in_notebook.check),
    and a probe after the last cell proves it (shown as data, which no worker can write), or none of
    these notebooks' checks is graded, with the reason. Returns the seconds it took.
    """
    import nbformat
    from nbclient import NotebookClient

    started = time.monotonic()
    paths = {a: os.path.join(out, "submitted", student, a, stem + ".ipynb") for a, stem in assignments.items()}
    books = {a: nbformat.read(path, as_version=4) for a, path in paths.items()}
    cells = [cell for book in books.values() for cell in book.cells if cell.cell_type == "code"]
    probe = nbformat.v4.new_code_cell(_PROBE)
    for attempt in (1, 2):
        client = NotebookClient(
            nbformat.v4.new_notebook(cells=cells + [probe], metadata=next(iter(books.values())).metadata),
            timeout=cell_timeout,
            allow_errors=True,
            interrupt_on_timeout=True,
            error_on_timeout={
                "ename": "CellTimeoutError",
                "evalue": f"still running after {cell_timeout} s: a hang that the launcher's own timeouts did not stop",
                "traceback": [],
            },
            resources={"metadata": {"path": code}},
        )
        try:
            output = {env.KERNEL_OUTPUT: output_file(out, student)}
            await client.async_execute(env=dict(os.environ, COURSE_IMPL=code, **output))
        except Exception as error:  # noqa: BLE001 - the kernel died: the cells it did not run fail, with the reason
            # A kernel that died before its first cell ran nothing of the student's: a second one
            # grades the notebooks. (Seen once in a fresh clone's test suite, "Kernel died before
            # replying to kernel_info"; likely a port that jupyter_client found free and let go,
            # taken by a worker before the kernel bound it. A new kernel gets new ports.)
            if attempt == 1 and all(cell.execution_count is None for cell in cells):
                continue
            reason = f"{type(error).__name__}: {error}".strip().splitlines()[0]
            _not_graded([cell for cell in cells if cell.execution_count is None], reason)
        else:
            # Every check of that student's fails, with the reason: what a kernel shows never stops the class.
            _not_graded(cells, _probe_failure(probe))
        break
    for assignment, book in books.items():
        nbformat.write(book, paths[assignment])
    return time.monotonic() - started


async def execute_all(
    out: str, codes: dict, assignments: dict, cell_timeout: int, jobs: int, then=None, finished=None
) -> dict:
    """execute() every student's notebooks, `jobs` kernels at a time; the seconds each took, by student.

    Each student's notebooks are shared among `jobs` kernels, so that one student, or the last
    ones of a class, use every core too (a kernel starts in a fraction of a second: kernels.py).
    then(student, part), if given, is called as soon as the notebooks in `part` have run;
    finished(student, seconds, students done so far) once all of a student's have.
    """
    slots = asyncio.Semaphore(jobs)
    per_student = max(1, min(len(assignments), jobs))
    names = list(assignments)
    parts = [(student, names[k::per_student]) for student in codes for k in range(per_student)]
    for student in codes:  # this run's output only: its kernels append to it
        os.makedirs(os.path.dirname(output_file(out, student)), exist_ok=True)
        open(output_file(out, student), "w").close()
    left = {student: sum(1 for s, _ in parts if s == student) for student in codes}
    total = dict.fromkeys(codes, 0.0)

    async def one(student: str, part: list) -> None:
        async with slots:
            total[student] += await execute(
                out, student, {a: assignments[a] for a in part}, codes[student], cell_timeout
            )
        if then is not None:
            then(student, part)
        left[student] -= 1
        if finished is not None and left[student] == 0:
            finished(student, total[student], sum(1 for n in left.values() if n == 0))

    await asyncio.gather(*(one(student, part) for student, part in parts))
    return total


def _reason(cell: dict) -> str:
    """What a graded cell's outputs say went wrong ('' when nothing did)."""
    for output in cell.get("outputs", []):
        if output["output_type"] == "error":
            if output["ename"] in ("CheckFailed", "NotGraded"):
                return output["evalue"]
            if output["ename"] == "KeyboardInterrupt":  # nbclient interrupts a cell at its time limit
                return "still running at the cell's time limit (--cell-timeout): an endless loop, or a wait that never ends?"
            return f"{output['ename']}: {output['evalue']}".rstrip(": ")
        if output["output_type"] == "stream" and output["name"] == "stderr":
            return "the cell wrote to stderr: " + "".join(output["text"]).strip().splitlines()[0]
    return ""


def _cases(cell: dict) -> dict | None:
    """What each case of a graded cell found, by case name, as grade() showed it (None: it did not)."""
    for output in cell.get("outputs", []):
        if output["output_type"] == "display_data" and CASES_MIME in output.get("data", {}):
            return {case["name"]: case for case in output["data"][CASES_MIME]["cases"]}
    return None


def _mistake(cell: dict) -> dict:
    """What became of a graded cell that showed no cases (it crashed, ran out of time, was not
    graded), as facts like course.grading.plugin.mistake's: the report groups by them."""
    for output in cell.get("outputs", []):
        if output["output_type"] == "error":
            if output["ename"] == "NotGraded":
                return {"kind": "kernel_died"}
            if output["ename"] in ("KeyboardInterrupt", "CellTimeoutError"):
                return {"kind": "cell_timeout"}
            return {"kind": "cell_error", "error": output["ename"]}
        if output["output_type"] == "stream" and output["name"] == "stderr":
            return {"kind": "stderr"}
    return {"kind": "no_points"}


def stub_of(mistake: dict | None) -> dict | None:
    """The code not written yet that a mistake's facts name, as Check.stub holds it (None for any other)."""
    if not mistake or mistake.get("kind") != "stub":
        return None
    return {"exercise": mistake["exercise"], "func": mistake["func"], "handout": by_number(mistake["exercise"]).handout}


def _seconds(cell: dict) -> float | None:
    """How long a cell ran, from the times nbclient records in its metadata."""
    from datetime import datetime

    times = cell.get("metadata", {}).get("execution", {})
    try:
        started, ended = (
            datetime.fromisoformat(times[k].replace("Z", "+00:00"))  # Python 3.10 reads no "Z"
            for k in ("iopub.execute_input", "shell.execute_reply")
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return round((ended - started).total_seconds(), 3)


def _notebook(out: str, step: str, student: str, assignment: str, stem: str) -> list:
    path = os.path.join(out, step, student, assignment, stem + ".ipynb")
    if not os.path.exists(path):  # nbgrader removes a notebook it failed to grade
        return []
    with open(path) as f:
        return json.load(f)["cells"]


def collect(out: str, student: str, assignments: dict, failures: dict) -> list:
    """The student's checks, one per case as `make grade` has them (course/grading/points.py), from what
    each graded cell showed; nbgrader's gradebook records the same points for the cell."""
    from nbgrader.api import Gradebook, MissingEntry

    checks = []
    with Gradebook(f"sqlite:///{os.path.join(out, 'gradebook.db')}") as gradebook:
        for assignment, stem in assignments.items():
            graded = {
                c["metadata"]["nbgrader"]["grade_id"]: c
                for c in _notebook(out, "autograded", student, assignment, stem)
                if "nbgrader" in c["metadata"]
            }
            try:
                grades = {g.name: g for g in gradebook.find_submission_notebook(stem, assignment, student).grades}
            except MissingEntry:
                grades = {}
            for cell in _notebook(out, "release", ".", assignment, stem):
                grading = cell["metadata"].get("nbgrader", {})
                if not grading.get("grade") or grading.get("solution"):  # written answers are graded by hand
                    continue
                ran = graded.get(grading["grade_id"], {})
                found = None if assignment in failures else _cases(ran)
                reason = failures.get(assignment) or _reason(ran) or "no points"
                facts = {"kind": "not_graded"} if assignment in failures else _mistake(ran)
                mine = []
                for case in cell["metadata"]["course"]["cases"]:
                    unseen = {"passed": False, "message": reason, "mistake": facts, "seconds": _seconds(ran)}
                    got = (found or {}).get(case["name"]) or unseen
                    passed = got["passed"] is True
                    mine.append(
                        Check(
                            int(assignment[2:]),
                            case["name"],
                            passed,
                            "" if passed else got["message"],
                            case["points"],
                            stub=None if passed else stub_of(got["mistake"]),
                            mistake=None if passed else got["mistake"],
                            seconds=got["seconds"],
                        )
                    )
                checks += mine
                grade = grades.get(grading["grade_id"])
                if grade is not None:  # one grade: the gradebook holds what the cases earned
                    grade.auto_score, grade.needs_manual_grade = sum(c.score for c in mine), False
        gradebook.db.commit()
    return checks


def feedback_html(student: str, checks: list, out: str, assignments: dict) -> str:
    """One student's feedback page: the table, every check with its points and what it found, the written answers."""
    import nbformat
    from nbconvert import HTMLExporter

    md = nbformat.v4.new_markdown_cell
    cells = [
        md(
            f"# Feedback for {html.escape(student)}\n\nThe checks are graded automatically, the written answers by hand.\n\n<pre>{html.escape(table(checks))}</pre>"
        )
    ]
    for assignment, stem in assignments.items():
        exercise = int(assignment[2:])
        items = [
            f"<li><b>{html.escape(c.name)}</b>: {'passed' if c.passed else 'failed'}, {c.score:g}/{c.max_score:g}"
            + ("" if c.passed else f"<br><code>{html.escape(c.message)}</code>")
            + "</li>"
            for c in checks
            if c.exercise == exercise
        ]
        cells.append(md(f"## Exercise {exercise}\n\n<ul>\n{chr(10).join(items)}\n</ul>"))
        for cell in _notebook(out, "submitted", student, assignment, stem):
            if cell["metadata"].get("nbgrader", {}).get("solution"):
                answer = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
                # Escaped: the answer's Markdown shows, any HTML or script in it is only text.
                cells += [
                    md(f"**Your answer to {html.escape(cell['id'])}** (graded by hand):"),
                    md(html.escape(answer)),
                ]
    body, _ = HTMLExporter().from_notebook_node(
        nbformat.v4.new_notebook(cells=cells, metadata={"title": f"Feedback for {student}"})
    )
    return body


def export_csv(out: str) -> str:
    from nbgrader.api import Gradebook
    from nbgrader.plugins import CsvExportPlugin

    path = os.path.join(out, "grades.csv")
    with Gradebook(f"sqlite:///{os.path.join(out, 'gradebook.db')}") as gradebook:
        CsvExportPlugin(to=path).export(gradebook)
    return path


def _import_what_follows_the_kernels() -> None:
    """Before the first kernel starts a world of submission code, import every module this process
    uses after that (starting kernels, recording, feedback, the report): none is then read from
    disk once submission code has run (course/runtime/sandbox.py keeps workers from writing there; this
    does not rely on it). tests/import_audit.py finds what is missing here."""
    import encodings.ascii  # noqa: F401 - a codec they look up by name
    import multiprocessing.popen_forkserver  # noqa: F401 - course/instructors/kernels.py starts each kernel with it

    import nbformat
    import nbgrader.api  # noqa: F401 - collect, export_csv
    import nbgrader.converters  # noqa: F401 - record
    import nbgrader.plugins  # noqa: F401 - export_csv
    import psutil  # noqa: F401 - jupyter_client, when a kernel stops
    from jupyter_client.kernelspec import KernelSpecManager
    from nbconvert import HTMLExporter

    KernelSpecManager().get_kernel_spec("python3")  # what finding the kernel imports (ipykernel, IPython)
    # nbconvert loads its templates, filters and Markdown plugins on a first page.
    HTMLExporter().from_notebook_node(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("*x*")]))


def grade_all(submissions: str, out: str, cell_timeout: int, jobs: int = 1, exercises: list | None = None) -> dict:
    """Grade every student's folder in submissions, on every exercise or on `exercises`; return their checks by student."""
    from nbgrader.converters import Autograde

    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    config = _nbgrader_config(out)
    assignments = make_assignments(out, config, exercises)
    students = sorted(
        d for d in os.listdir(submissions) if os.path.isdir(os.path.join(submissions, d)) and not d.startswith(".")
    )
    taken = {student: take_in(os.path.join(submissions, student), student, out, assignments) for student in students}
    codes = {student: code for student, (code, _) in taken.items()}
    advisory = _advisory(next(iter(codes.values()), None))
    _import_what_follows_the_kernels()

    def record(student: str, part: list) -> tuple:
        """nbgrader's record of notebooks that have run: the reasons of those it could not grade, its seconds."""
        started, failures = time.monotonic(), {}
        for assignment in part:
            error = _run(Autograde, config, assignment, student)
            if error:
                failures[assignment] = f"the notebook could not be graded: {error}"
        return failures, time.monotonic() - started

    # nbgrader records a kernel's notebooks in this thread while the next kernels run: recording
    # is one process's work, and would otherwise leave the other cores idle at the end.
    started = time.monotonic()
    with ThreadPoolExecutor(1) as recorder:
        records = {student: [] for student in students}

        def ran(student: str, part: list) -> None:
            records[student].append(recorder.submit(record, student, part))

        def finished(student: str, seconds: float, done: int) -> None:
            left = (time.monotonic() - started) / done * (len(students) - done)
            print(
                f"[{done}/{len(students)}] {student}: its checks ran {seconds:.1f} s; about {left:.0f} s left",
                flush=True,
            )

        executed = asyncio.run(execute_all(out, codes, assignments, cell_timeout, jobs, then=ran, finished=finished))
    results = {}
    for student in students:
        failures = {}
        for done in records[student]:
            failures.update(done.result()[0])
        feedback = os.path.join(out, "feedback", student)
        # Exercises graded before and not now are kept: one late student's run replaces no one's grades.
        checks = merge(feedback, collect(out, student, assignments, failures))
        notes = "\n".join(taken[student][1])  # what of the submission could not be read
        said = "\n".join(filter(None, [notes, advisory and f"This grade is advisory: {advisory}."]))
        write_results(os.path.join(feedback, "results.json"), checks, executed[student], said, advisory)
        with open(os.path.join(feedback, "feedback.txt"), "w") as f:
            f.write(f"Autograded checks of {student} (written answers are graded by hand):\n\n{table(checks)}\n")
            f.write(f"{notes}\n" if notes else "")
        with open(os.path.join(feedback, "feedback.html"), "w") as f:
            f.write(feedback_html(student, checks, out, assignments))
        results[student] = checks
        print(f"{student}: {sum(c.score for c in checks):g}/{sum(c.max_score for c in checks):g}", flush=True)
    export_csv(out)
    report.write(out, graded_before(out) | results, advisory)
    return results


def _advisory(code: str | None) -> str:
    """Why the grades of this run are advisory ('' if they are not): the sandbox that the kernels'
    checks will run submission code in (course/runtime/sandbox.py), tried on one student's code folder,
    which every other student's is like."""
    import importlib.util

    if code is None:
        return ""
    torch = os.path.dirname(importlib.util.find_spec("torch").origin)
    try:
        return sandbox.level((ROOT, code, torch), code).advisory
    except sandbox.NoSandbox as refused:  # COURSE_SANDBOX=required: the checks will refuse to run
        return str(refused)


_CHECKS = "checks.json"  # in feedback/STUDENT/: every check of the student graded so far, by exercise


def merge(feedback: str, checks: list) -> list:
    """The student's checks of earlier runs, those of the exercises graded now replaced by checks;
    written back to feedback/STUDENT/checks.json."""
    os.makedirs(feedback, exist_ok=True)
    now = {c.exercise for c in checks}
    kept = [c for c in _read_checks(feedback) if c.exercise not in now]
    merged = sorted(kept + checks, key=lambda c: (c.exercise, c.name))
    with open(os.path.join(feedback, _CHECKS), "w") as f:
        json.dump([dataclasses.asdict(c) for c in merged], f, indent=1)
    return merged


def _read_checks(feedback: str) -> list:
    try:
        with open(os.path.join(feedback, _CHECKS)) as f:
            return [Check(**c) for c in json.load(f)]
    except (OSError, ValueError, TypeError):
        return []


def graded_before(out: str) -> dict:
    """Every student graded into out so far, with their checks: the class report is the whole class's."""
    folder = os.path.join(out, "feedback")
    students = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return {s: checks for s in students if (checks := _read_checks(os.path.join(folder, s)))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("submissions", help="a folder with one folder per student")
    parser.add_argument("--out", default="grading", help="nbgrader's course folder and the grades (default: grading)")
    parser.add_argument("--cell-timeout", type=int, default=300, help="seconds one notebook cell may run")
    parser.add_argument(
        "--jobs",
        type=int,
        default=env.usable_cores(),
        help="students whose checks run at once (default: the usable cores)",
    )
    parser.add_argument(
        "--ex", type=int, action="append", help="grade only this exercise (again for more; default: every exercise)"
    )
    args = parser.parse_args(argv)
    sandbox.protect()
    os.environ.update(env.check_settings(), COURSE_MISTAKE_FACTS="1")  # the kernels' checks show their facts
    os.environ["COURSE_FOR_CREDIT"] = "1"  # each call of a check in a process of its own (course/runtime/workers.py)
    if sys.platform.startswith(
        "linux"
    ):  # kernels forked from a server that imported torch once (course/instructors/kernels.py)
        os.environ.setdefault("JUPYTER_DEFAULT_PROVISIONER_NAME", "course-forked")
    if os.environ.get("JUPYTER_DEFAULT_PROVISIONER_NAME") == "course-forked":
        from course.instructors import kernels

        kernels.start_server()  # its imports (about 3 s of CPU) beside nbgrader's and the assignments
    warnings.filterwarnings("ignore", module=r"nbgrader\.")  # its own SQLAlchemy session warnings
    import nbgrader.api

    nbgrader.api.get_alembic_version = _gradebook_version
    try:
        grade_all(args.submissions, args.out, args.cell_timeout, args.jobs, args.ex)
    finally:
        for process in mp.active_children():  # a kernel nbgrader did not stop
            process.kill()
    print(f"grades: {os.path.join(args.out, 'grades.csv')}; feedback: {os.path.join(args.out, 'feedback')}/STUDENT/")
    print(
        f"class report: {os.path.join(args.out, 'report.html')} (and report.json; python -m course.instructors.report {args.out})"
    )
    return 0


if __name__ == "__main__":
    code = main()
    # Tearing down what nbgrader, nbconvert and torch built, object by object, takes 1 to 2 s here and
    # leaves nothing an exit would not: run the exit handlers, flush, and end the process.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
