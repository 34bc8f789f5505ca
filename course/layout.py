"""Where the course's pieces are, in one place: every module that needs one of these imports it here.

A new exercise file is one entry in STUDENT_FILES; a new exercise is a tests/test_exN_*.py module
(its checks), a handout exercises/NN_*.md and a notebook source solutions/notebooks/NN_*.md.
"""

from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLUTIONS = os.path.join(ROOT, "solutions")
TESTS = os.path.join(ROOT, "tests")

# The files students write; the instructors' repository generates them from solutions/ (course/student.py).
STUDENT_FILES = (
    "mlp.py",
    "dist.py",
    "mydp.py",
    "data.py",
    "sync.py",
    "hvd.py",
    "zero.py",
    "cost.py",
    "fsdp.py",
    "tp.py",
    "pp.py",
    "nd.py",
)
STUDENT_MODULES = tuple(name[: -len(".py")] for name in STUDENT_FILES)

# nbgrader's markers around what a student writes.
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


def graded_exercises() -> list[int]:
    """The exercises `make grade` grades: one tests/test_exN_*.py module each."""
    found = (
        re.fullmatch(r"test_ex(\d+)_\w+\.py", os.path.basename(path))
        for path in glob.glob(os.path.join(TESTS, "test_ex*_*.py"))
    )
    return sorted(int(m.group(1)) for m in found if m)


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
