"""Write the students' copy of the course: ``python -m course.release DEST``.

The copy holds what students need and may see: their three files, the handouts and notebooks,
the exercise checks with the test helpers, the course package, the Makefile, README and the
packaging files. It leaves out solutions/, the instructors' tests (the mutant tests need
solutions/, the others test this repository), CI, and any gradebook or grades. Without
solutions/ the Makefile's `make test` is `make grade`.

``leaks(dest)`` proves nothing of a solution made it into the copy: it lists every line of the
copy that is a line written inside a solution region in solutions/ (the .py files and the
notebook sources). Lines are compared stripped of indentation. Three kinds of solution lines are
not secret and are not reported:
- blank lines;
- lines that also appear outside every solution region of solutions/: the students get them anyway
  (``if rank != 0:``);
- short, common statements, SHORT characters or fewer, that the released support code (course/,
  tests/) also contains: ``continue``, ``return None``, ``with torch.no_grad():``. On its own such
  a line tells nothing; a longer line, or a short one found nowhere else, is reported.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import sys

from course.student import BEGIN, END, ROOT, SOLUTIONS

RELEASED = (
    "mlp.py", "dist.py", "mydp.py", "Makefile", "README.md", "pyproject.toml", "requirements.txt", "requirements-notebooks.txt", ".gitignore",
    "course/*.py", "bench/*.py", "exercises/*.md", "exercises/*.ipynb",
    "tests/__init__.py", "tests/conftest.py", "tests/helpers.py", "tests/comm_log.py", "tests/test_ex*_*.py",
)


def released_files(root: str = ROOT) -> list:
    """The released paths, relative to root."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for name in files:
            path = os.path.relpath(os.path.join(folder, name), root)
            if any(fnmatch.fnmatch(path, pattern) and path.count(os.sep) == pattern.count("/") for pattern in RELEASED):
                found.append(path)
    return sorted(found)


def release(dest: str) -> list:
    if os.path.exists(dest) and os.listdir(dest):
        raise FileExistsError(f"{dest} is not empty: the release goes into a new folder")
    files = released_files()
    for path in files:
        os.makedirs(os.path.dirname(os.path.join(dest, path)), exist_ok=True)
        shutil.copyfile(os.path.join(ROOT, path), os.path.join(dest, path))
    return files


def text_lines(path: str) -> list:
    """The lines of a file as a reader sees them; a notebook's are those of its cells."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        return []
    if path.endswith(".ipynb"):
        cells = json.loads(text)["cells"]
        return [line for c in cells for line in ("".join(c["source"]) if isinstance(c["source"], list) else c["source"]).splitlines()]
    return text.splitlines()


SHORT = 24


def secret_lines(solutions: str = SOLUTIONS) -> set:
    """The stripped lines of solution regions in solutions/ that a release must not contain."""
    inside, outside = set(), set()
    for folder, _, files in os.walk(solutions):
        for name in files:
            region = False
            for line in text_lines(os.path.join(folder, name)):
                if line.strip() in (BEGIN, END):
                    region = line.strip() == BEGIN
                    continue
                (inside if region else outside).add(line.strip())
    support = {line.strip() for path in released_files() if path.startswith(("course", "tests")) for line in text_lines(os.path.join(ROOT, path))}
    common = {line for line in inside if len(line) <= SHORT and line in support}
    return inside - outside - common - {""}


def leaks(dest: str) -> list:
    """(path, line) for every line of the copy at dest that is a secret solution line."""
    secret = secret_lines()
    found = []
    for folder, _, files in os.walk(dest):
        for name in files:
            path = os.path.join(folder, name)
            found += [(os.path.relpath(path, dest), line.strip()) for line in text_lines(path) if line.strip() in secret]
    return found


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m course.release DEST")
    written = release(sys.argv[1])
    found = leaks(sys.argv[1])
    if found:
        raise SystemExit("solution lines in the release:\n" + "\n".join(f"  {p}: {line}" for p, line in found))
    print(f"wrote {len(written)} files to {sys.argv[1]}; no solution line among them")
