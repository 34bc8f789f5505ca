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
