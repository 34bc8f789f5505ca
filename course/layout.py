"""Where the course's pieces are, and which of them the students' copy holds.

The exercises themselves are listed once, in course/exercises.py; everything here that names an
exercise's files reads them from there. This module imports nothing of the course but that list.
"""

from __future__ import annotations

import fnmatch
import os

from course.exercises import EXERCISES, STUDENT_FILES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLUTIONS = os.path.join(ROOT, "solutions")
# The checks that grade: a folder of their own, which the students' copy holds whole.
CHECKS = os.path.join(ROOT, "checks")

# nbgrader's markers around what a student writes.
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"

# What the students' copy holds (course/instructors/release.py writes it; the grading sandbox shows
# the same files to a submission's workers): the patterns, each matching within its own folder.
RELEASED = (
    *STUDENT_FILES,
    "Makefile",
    "README.md",
    "pyproject.toml",
    "requirements.txt",
    "requirements-notebooks.txt",
    ".gitignore",
    "course/*.py",
    "course/runtime/*.py",
    "course/grading/*.py",
    "checks/*.py",  # the checks, their helpers and contracts: read from the docstrings, no solution
    "bench/*.py",
    "bench/*.json",  # the measurements of docs/benchmarks.md, and their figures
    "bench/*.png",
    "exercises/*.md",
    "exercises/*.ipynb",
    "exercises/*.svg",
    "docs/*.md",  # the README links them
)
# Of those, what serves instructors only. Their tools are the folder course/instructors/, which
# no pattern above matches.
INSTRUCTORS_ONLY = (
    "bench/grade_time.py",
    "docs/instructors.md",
    "docs/design.md",
    "docs/classroom.md",
)


def released_files(root: str = ROOT) -> list:
    """The released paths, relative to root."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for name in files:
            path = os.path.relpath(os.path.join(folder, name), root)
            if path in INSTRUCTORS_ONLY:
                continue
            if any(fnmatch.fnmatch(path, pattern) and path.count(os.sep) == pattern.count("/") for pattern in RELEASED):
                found.append(path)
    return sorted(found)


def instructors_repository(root: str = ROOT) -> bool:
    """Whether root is the instructors' repository (with solutions/), not a students' copy."""
    return os.path.isdir(os.path.join(root, "solutions"))


def graded_exercises() -> list[int]:
    """The exercises `make grade` grades: each one whose checks are here."""
    return [e.number for e in EXERCISES if os.path.isfile(os.path.join(ROOT, e.checks))]


def course_folder_of(path: str) -> str | None:
    """The course checkout that holds `path` (a folder with course/layout.py), or None."""
    path = os.path.realpath(path)
    while True:
        if os.path.isfile(os.path.join(path, "course", "layout.py")):
            return path
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def graded_elsewhere(cwd: str, root: str = ROOT) -> str | None:
    """A sentence naming the folder `make grade` grades when it is not the one the student is in.

    The files graded are those beside the course package this Python imported: with one .venv
    shared by two clones (an editable install), a grade run in the second clone grades the first.
    """
    here = course_folder_of(cwd)
    if here == os.path.realpath(root):
        return None
    where = f"you are in {here}" if here else f"{os.path.realpath(cwd)} is in no copy of the course"
    return (
        f"Grading the files in {root}, the copy of the course this Python's `course` package comes from; "
        f"{where}. To grade another copy, run its own .venv's python (or `make grade`) in it."
    )
