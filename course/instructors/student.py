"""Make the student files from the reference solutions: ``python -m course.instructors.student``.

It also writes the students' exercise notebooks from solutions/notebooks/ (course/instructors/make_notebooks.py).

solutions/ is the single source of truth. Every region between ``### BEGIN SOLUTION`` and
``### END SOLUTION`` (nbgrader's markers) becomes a stub that raises NotImplementedError naming the
exercise, the function and the handout. The exercise comes from the nearest ``TODO(exercise N)``
comment above the region, which the student keeps as the instruction.
"""

from __future__ import annotations

import os
import re
import sys

from course.exercises import STUDENT_FILES, stub_message
from course.instructors.make_notebooks import write_student_notebooks
from course.layout import BEGIN, END, ROOT, SOLUTIONS

LINE_LENGTH = 120  # [tool.ruff] line-length
_TODO = re.compile(r"TODO\(exercise (\d+)\)")
_DEF = re.compile(r"^(\s*)(?:async\s+)?(def|class)\s+(\w+)")

HEADER = "# Your copy of the exercise code: fill in every TODO, then `make grade` checks it.\n"
# Last, so that the lines above keep their numbers: until the student writes a TODO, its stub leaves
# imports unused and later lines' names undefined, which `make lint` (ruff) would report.
FOOTER = "\n# ruff: noqa: F401, F821, F841, B007 - what a stub leaves unused or undefined until it is written\n"


def _enclosing_name(lines: list, index: int) -> str:
    """Qualified name (Class.method) of the def that contains line `index`."""
    indent = len(lines[index]) - len(lines[index].lstrip())
    names = []
    for line in reversed(lines[:index]):
        m = _DEF.match(line)
        if m and len(m.group(1)) < indent:
            names.append(m.group(3))
            indent = len(m.group(1))
    return ".".join(reversed(names)) or "<module>"


def stub_source(source: str, name: str) -> str:
    """The student version of one solution file."""
    lines = source.splitlines(keepends=True)
    out, exercise, i = [HEADER], None, 0
    while i < len(lines):
        line = lines[i]
        todo = _TODO.search(line)
        if todo:
            exercise = int(todo.group(1))
        if line.strip() != BEGIN:
            out.append(line)
            i += 1
            continue
        if exercise is None:
            raise ValueError(f"{name}:{i + 1}: solution region without a TODO(exercise N) comment above it")
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == END), None)
        if end is None:
            raise ValueError(f"{name}:{i + 1}: {BEGIN} without {END}")
        indent = line[: len(line) - len(line.lstrip())]
        message = stub_message(exercise, _enclosing_name(lines, i))
        stub = f'{indent}raise NotImplementedError("{message}")\n'
        if len(stub) - 1 > LINE_LENGTH:  # as ruff format wraps it (pyproject.toml), so that `make lint` passes
            stub = f'{indent}raise NotImplementedError(\n{indent}    "{message}"\n{indent})\n'
        out.append(stub)
        i = end + 1
    return "".join(out) + FOOTER


def generate(dest: str = ROOT) -> list:
    """Write the student files into dest; return their paths."""
    written = []
    for name in STUDENT_FILES:
        with open(os.path.join(SOLUTIONS, name)) as f:
            text = stub_source(f.read(), name)
        path = os.path.join(dest, name)
        with open(path, "w") as f:
            f.write(text)
        written.append(path)
    return written


if __name__ == "__main__":
    for path in generate(sys.argv[1] if len(sys.argv) > 1 else ROOT) + write_student_notebooks():
        print(f"wrote {os.path.relpath(path)}")
