"""The exercise notebooks, made from short Markdown sources in solutions/notebooks/.

A source reads as a document. Its text becomes markdown cells and its fenced blocks become:

    ```python                        a code cell (the imports)
    ```python demo                   a code cell that runs the student's code to show it working,
                                     tagged "demo": autograding leaves it out
    ```python test                  a graded cell: `grade(test_x)` runs every case of the check
                                     test_x of `make grade` (checks/test_exNN_*.py); its points are the
                                     check's (course/grading/points.py), and nbgrader grades it
    ```answer id=ID points=N         a written answer graded by hand; its model answer sits
                                     between ### BEGIN SOLUTION and ### END SOLUTION

``notebook(path, solutions=True)`` is the instructor's version, the source nbgrader makes an
assignment from. With ``solutions=False`` each model answer becomes "YOUR ANSWER HERE", as in
nbgrader's own release: that is the student's copy, exercises/NN_name.ipynb, written by
``make student`` and committed. The notebooks keep to their own explanations and point to the
Markdown handouts for the task itself.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys

from course.exercises import EXERCISES, by_number
from course.layout import BEGIN, END, ROOT, SOLUTIONS

SOURCES = os.path.join(SOLUTIONS, "notebooks")
ANSWER_STUB = "YOUR ANSWER HERE"
_FENCE = re.compile(r"^```(python|answer)\b(.*)$")


def sources() -> list:
    """Every exercise's notebook source, in the exercises' order."""
    return [os.path.join(ROOT, exercise.notebook_source) for exercise in EXERCISES]


def exercise_of(path: str) -> int:
    return int(os.path.basename(path)[:2])


def _cell(kind: str, text: str, index: int, stem: str, grading: dict | None = None) -> dict:
    cell = {"cell_type": kind, "id": f"{stem}-{index}", "metadata": {}, "source": text.strip("\n")}
    if grading is not None:
        cell["id"] = grading["grade_id"]
        cell["metadata"]["nbgrader"] = grading | {"schema_version": 3, "task": False}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def _without_solution(text: str) -> str:
    lines = text.splitlines()
    begin, end = lines.index(BEGIN), lines.index(END)
    return "\n".join(lines[:begin] + [ANSWER_STUB] + lines[end + 1 :])


def cells(text: str, stem: str, solutions: bool) -> list:
    out, prose, lines = [], [], iter(text.splitlines())
    for line in lines:
        fence = _FENCE.match(line)
        if not fence:
            prose.append(line)
            continue
        if "\n".join(prose).strip():
            out.append(_cell("markdown", "\n".join(prose), len(out), stem))
        prose, body = [], []
        for line in lines:
            if line == "```":
                break
            body.append(line)
        body = "\n".join(body)
        kind, options = fence.group(1), dict(re.findall(r"(\w+)=(\S+)", fence.group(2)))
        if kind == "answer":
            grading = dict(
                grade=True, solution=True, locked=False, grade_id=options["id"], points=int(options["points"])
            )
            out.append(_cell("markdown", body if solutions else _without_solution(body), len(out), stem, grading))
        elif "test" in fence.group(2).split():
            out.append(_graded_cell(body, len(out), stem))
        else:
            out.append(_cell("code", body, len(out), stem))
            if "demo" in fence.group(2).split():
                out[-1]["metadata"]["tags"] = ["demo"]
    if "\n".join(prose).strip():
        out.append(_cell("markdown", "\n".join(prose), len(out), stem))
    return out


_GRADE = re.compile(r"grade\((test_\w+)\)")


def check_module(exercise: int) -> str:
    """checks.test_exNN_name, the checks of an exercise (importable from any folder)."""
    if ROOT not in sys.path:
        sys.path.append(ROOT)
    return by_number(exercise).checks_module


def _graded_cell(body: str, index: int, stem: str) -> dict:
    """A cell `grade(test_x)`: worth the points of test_x's cases, which its metadata lists."""
    from course.grading.points import cases

    match = _GRADE.fullmatch(body.strip())
    if match is None:
        raise ValueError(f"{stem}: a graded cell holds one call, grade(test_...), not {body!r}")
    exercise = int(stem.split("_")[0])
    test = getattr(importlib.import_module(check_module(exercise)), match.group(1))
    found = cases(test)
    grading = dict(
        grade=True,
        solution=False,
        locked=True,
        grade_id=f"ex{exercise}_{test.__name__.removeprefix('test_')}",
        points=sum(case.points for case in found),
    )
    cell = _cell("code", body, index, stem, grading)
    cell["metadata"]["course"] = {"cases": [{"name": case.name, "points": case.points} for case in found]}
    return cell


def notebook(path: str, solutions: bool = True) -> dict:
    stem = os.path.basename(path)[: -len(".md")]
    with open(path) as f:
        text = f.read()
    return {
        "cells": cells(text, stem, solutions),
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def dumps(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def student_path(source: str) -> str:
    """Where the student's copy of a notebook lives: exercises/NN_name.ipynb."""
    return os.path.join(ROOT, "exercises", os.path.basename(source)[: -len(".md")] + ".ipynb")


def write_student_notebooks() -> list:
    written = []
    for source in sources():
        path = student_path(source)
        with open(path, "w") as f:
            f.write(dumps(notebook(source, solutions=False)))
        written.append(path)
    return written
