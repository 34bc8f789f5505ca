"""A Gradescope autograder for the course: ``python -m course.instructors.gradescope build autograder.zip [--ex N ...]``.

The zip holds the students' copy of the course (course/instructors/release.py: the checks, the course
package, the stub files) and Gradescope's two scripts:

- ``setup.sh``, run once as root when Gradescope builds its image: a virtual environment in
  /autograder/venv with torch's CPU wheel (PyPI's Linux wheel brings several GB of CUDA), numpy
  and pytest, every file readable by every user (the uid sandbox runs submission code as users of
  its own: course/runtime/sandbox.py).
- ``run_autograder``, run for each submission: ``python -m course.instructors.gradescope run``. It takes the
  student files from wherever they sit in the upload (the folder that holds the most of them;
  anything else in the upload is ignored), fills in a file that is missing with its stub, grades them in the
  sandbox (COURSE_SANDBOX=required: without one, no grade), and writes
  /autograder/results/results.json, with a note saying which file came from where.

The zip also holds the reference solutions, in judge/: where the grade counts, a check draws cases as it
grades and the reference answers them (checks/helpers.py's judged()). setup.sh moves them out of the
course, to /autograder/judge, readable by root only: no submission's world sees them, at any sandbox
level, and the zip is the instructors' to keep, never the students'.

GRADESCOPE_ROOT stands for /autograder (tests/grading/test_gradescope.py runs a stand-in of its folders).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile

from course.exercises import STUDENT_FILES
from course.layout import ROOT, SOLUTIONS

SETUP = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (course/instructors/gradescope.py).
set -euo pipefail
cd /autograder/source
apt-get install -y python3-venv >/dev/null 2>&1 || true
python3 -m venv /autograder/venv
# torch's CPU wheel: PyPI's Linux wheel would bring several GB of CUDA libraries.
/autograder/venv/bin/pip install --quiet --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
/autograder/venv/bin/pip install --quiet -r requirements.txt
# The reference solutions that judge the drawn cases: out of the course, root's only.
mv /autograder/source/judge /autograder/judge
chmod -R go-rwx /autograder/judge
# The uid sandbox runs submission code as users of its own: they must read Python and the course.
chmod -R a+rX /autograder/source /autograder/venv
chmod a+x /autograder
"""

RUN = """#!/usr/bin/env bash
# Gradescope runs this for each submission (course/instructors/gradescope.py).
root="${{GRADESCOPE_ROOT:-/autograder}}"
cd "$root/source"
exec "$root/venv/bin/python" -m course.instructors.gradescope run --root "$root"{exercises}
"""

# Folders an upload may hold that are never a student's files: an archiver's, a tool's.
_SKIPPED = {"__MACOSX", "__pycache__", ".git", ".ipynb_checkpoints", ".venv", "venv", "node_modules"}


def build(out: str, exercises: list | None = None) -> str:
    """Write the autograder zip to out; return its path. Raises ValueError for a number that is
    not an exercise: every submission would be refused."""
    from course.grading.results import no_such_exercise
    from course.instructors.release import release

    problem = no_such_exercise(exercises)
    if problem:
        raise ValueError(problem)

    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "source")
        release(source)
        shutil.copyfile(__file__, os.path.join(source, "course", "gradescope.py"))  # run_autograder's own
        scripts = {
            "setup.sh": SETUP,
            "run_autograder": RUN.format(exercises="".join(f" --ex {n}" for n in exercises or [])),
        }
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
            for top, _, files in os.walk(source):
                for name in sorted(files):
                    path = os.path.join(top, name)
                    archive.write(path, os.path.relpath(path, source))
            for name in STUDENT_FILES:
                archive.write(os.path.join(SOLUTIONS, name), os.path.join("judge", name))
            for name, text in scripts.items():
                entry = zipfile.ZipInfo(name)
                entry.external_attr = (stat.S_IFREG | 0o755) << 16
                archive.writestr(entry, text)
    return out


def find_student_files(upload: str) -> dict:
    """The path of each student file in an upload, at any depth: from the folder that holds the most
    of them (the shallowest of those, then the first in sorted order), and a file that folder lacks
    from the shallowest folder that has it. Names that are nowhere are left out."""
    by_folder: dict = {}
    for top, dirs, files in os.walk(upload):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED and not d.startswith("."))
        mine = [n for n in sorted(set(files) & set(STUDENT_FILES)) if not os.path.islink(os.path.join(top, n))]
        if mine:
            by_folder[top] = mine
    depth = lambda folder: os.path.relpath(folder, upload).count(os.sep) + (folder != upload)  # noqa: E731
    ranked = sorted(by_folder, key=lambda folder: (-len(by_folder[folder]), depth(folder), folder))
    found: dict = {}
    for folder in ranked[:1] + sorted(ranked[1:], key=lambda folder: (depth(folder), folder)):
        for name in by_folder[folder]:
            found.setdefault(name, os.path.join(folder, name))
    return found


def take_in(upload: str, dest: str) -> list:
    """Copy the submission's student files into dest, each missing one as its stub; the notes that say which."""
    found = find_student_files(upload)
    os.makedirs(dest, exist_ok=True)
    notes = []
    for name in STUDENT_FILES:
        if name in found:
            shutil.copyfile(found[name], os.path.join(dest, name))
            where = os.path.relpath(found[name], upload)
            if where != name:
                notes.append(f"{name}: graded from {where}")
        else:
            shutil.copyfile(os.path.join(ROOT, name), os.path.join(dest, name))  # this copy's stub
            notes.append(f"{name}: not in the submission, graded as the untouched file")
    os.chmod(dest, 0o755)
    for name in STUDENT_FILES:
        os.chmod(os.path.join(dest, name), 0o644)
    return notes


def run(root: str, exercises: list | None = None) -> int:
    """Grade the submission in root/submission into root/results/results.json."""
    results = os.path.join(root, "results", "results.json")
    os.makedirs(os.path.dirname(results), exist_ok=True)
    graded = tempfile.mkdtemp(prefix="submission-", dir=os.path.join(root, "results"))
    notes = take_in(os.path.join(root, "submission"), graded)
    command = [sys.executable, "-m", "course", "grade", *[f"--ex={n}" for n in exercises or []], "--results", results]
    env = dict(os.environ, COURSE_IMPL=graded, COURSE_SANDBOX=os.environ.get("COURSE_SANDBOX", "required"))
    env["COURSE_FOR_CREDIT"] = "1"  # each call of a check in a process of its own (course/runtime/workers.py)
    env["COURSE_JUDGE"] = os.path.join(root, "judge")  # where setup.sh put the reference solutions
    done = subprocess.run(command, cwd=ROOT, env=env)
    shutil.rmtree(graded, ignore_errors=True)
    from course.grading.results import not_graded, write_json

    try:
        with open(results) as f:
            found = json.load(f)
    except (OSError, ValueError) as error:  # the grader ended before it wrote any: still no plausible 0
        found = not_graded([f"the grader ended (exit status {done.returncode}) without a results.json: {error}"])
    if notes:
        found["output"] = "\n".join(notes) + "\n\n" + found.get("output", "")
    write_json(results, found)
    return done.returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    making = commands.add_parser("build", help="write the autograder zip")
    making.add_argument("out", nargs="?", default="autograder.zip")
    grading = commands.add_parser("run", help="grade a submission (what run_autograder does)")
    grading.add_argument("--root", default=os.environ.get("GRADESCOPE_ROOT", "/autograder"))
    for command in (making, grading):
        command.add_argument("--ex", type=int, action="append", help="only this exercise (again for more)")
    args = parser.parse_args(argv)
    if args.command == "build":
        try:
            print(f"wrote {build(args.out, args.ex)}: upload it as the assignment's autograder on Gradescope")
        except ValueError as refused:
            print(refused, file=sys.stderr)
            return 2
        return 0
    return run(args.root, args.ex)


if __name__ == "__main__":
    sys.exit(main())
