"""Write the students' copy of the course: ``python -m course.instructors.release DEST``.

The copy holds what students need and may see: their files, the handouts and notebooks, the
checks folder whole, the course package less its instructors' folder
(course/instructors/), the
benchmarks' scripts and measurements, the Makefile, the README and the documents it links, each
less its instructors' parts, and the packaging files. It leaves out solutions/, the instructors'
tests (the mutant tests need solutions/, the others test this repository), their modules and
documents, CI, and any gradebook or grades. Without solutions/ the Makefile's `make test` is
`make grade`, and `make help` lists what a student can run; every command, link and file the copy
names works or is there in it (tests/authoring/test_release.py).

``leaks(dest)`` proves nothing of a solution made it into the copy, in any file: code, handouts
and notebooks alike. A solution line is any line written inside a solution region of solutions/
(the .py files and the notebook sources' model answers). Lines are compared without whitespace,
and found anywhere, also inside a longer line or wrapped over two. Two kinds of solution lines
are not secret and are not reported:
- lines that also stand outside every solution region of solutions/: the students get them
  anyway (``rank, world_size = dist.get_rank(), dist.get_world_size()``);
- statements shorter than SUBSTANTIVE characters without whitespace (``return mean``,
  ``total = 0.0``), and those up to COMMON characters that the released support code (course/,
  checks/, bench/) also writes as a line (``optimizer.step()``): on its own such a line tells
  nothing. A longer line, or a short one found nowhere else, is reported.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import re
import shutil
import sys

from course.layout import BEGIN, END, ROOT, SOLUTIONS, released_files

# A markdown file's parts for instructors (what only their repository has) stand between these two
# lines; the copy's markdown files have none of them.
INSTRUCTORS_BEGIN, INSTRUCTORS_END = "<!-- instructors -->", "<!-- /instructors -->"


def release(dest: str) -> list:
    if os.path.exists(dest) and os.listdir(dest):
        raise FileExistsError(f"{dest} is not empty: the release goes into a new folder")
    files = released_files()
    for path in files:
        os.makedirs(os.path.dirname(os.path.join(dest, path)), exist_ok=True)
        if path.endswith(".md"):
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                text = for_students(f.read(), path)
            with open(os.path.join(dest, path), "w", encoding="utf-8") as f:
                f.write(text)
        else:
            shutil.copyfile(os.path.join(ROOT, path), os.path.join(dest, path))
    return files


def for_students(text: str, name: str = "README.md") -> str:
    """A markdown file without its instructors' parts (each between INSTRUCTORS_BEGIN and _END lines)."""
    kept, inside = [], False
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        if line.strip() == INSTRUCTORS_BEGIN:
            if inside:
                raise ValueError(f"{name}:{number}: {INSTRUCTORS_BEGIN} inside an instructors' part")
            inside = True
        elif line.strip() == INSTRUCTORS_END:
            if not inside:
                raise ValueError(f"{name}:{number}: {INSTRUCTORS_END} without {INSTRUCTORS_BEGIN}")
            inside = False
        elif not inside:
            kept.append(line)
    if inside:
        raise ValueError(f"{name}: {INSTRUCTORS_BEGIN} without {INSTRUCTORS_END}")
    return re.sub(r"\n{3,}", "\n\n", "".join(kept))


def text_lines(path: str) -> list:
    """The lines of a file as a reader sees them; a notebook's are those of its cells."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        return []
    if path.endswith(".ipynb"):
        cells = json.loads(text)["cells"]
        return [
            line
            for c in cells
            for line in ("".join(c["source"]) if isinstance(c["source"], list) else c["source"]).splitlines()
        ]
    return text.splitlines()


def squeeze(text: str) -> str:
    """Text without any whitespace: a statement reads the same however it is spaced or wrapped."""
    return "".join(text.split())


# A solution statement shorter than this, squeezed, is too common to give anything away
# (`total=0.0`, `returnmean`), and would be found inside unrelated prose and code.
SUBSTANTIVE = 16
# A statement up to this long that the released support code also writes as a line of its own
# is the common idiom of every training loop (`optimizer.step()`, `with torch.no_grad():`).
COMMON = 24


def secret_lines(solutions: str = SOLUTIONS) -> set:
    """The squeezed lines of solution regions in solutions/ that a release must not contain."""
    inside, outside = set(), set()
    for folder, _, files in os.walk(solutions):
        for name in files:
            region = False
            for line in text_lines(os.path.join(folder, name)):
                if line.strip() in (BEGIN, END):
                    region = line.strip() == BEGIN
                    continue
                if region:
                    inside.add(squeeze(line))
                else:  # given code stays given with its comment cut: `x = 1  # why` gives `x = 1`
                    outside.update({squeeze(line), squeeze(re.sub(r"\s#.*", "", line))})
    support = {
        squeeze(line)
        for path in released_files()
        if path.startswith(("course", "checks", "bench"))
        for line in text_lines(os.path.join(ROOT, path))
    }
    common = {line for line in inside if len(line) <= COMMON and line in support}
    return {line for line in inside - outside - common if len(line) >= SUBSTANTIVE}


def leaks(dest: str) -> list:
    """(path, line) for every line of the copy at dest where a secret solution line starts.

    Each released file is squeezed whole, so a statement is found inside a longer line, with its
    spaces changed, or wrapped over two lines of a handout.
    """
    secret = secret_lines()
    found = []
    for folder, _, files in os.walk(dest):
        for name in files:
            path = os.path.join(folder, name)
            lines = text_lines(path)
            squeezed = "".join(squeeze(line) for line in lines)
            starts = list(itertools.accumulate(len(squeeze(line)) for line in lines))
            for statement in secret:
                at = squeezed.find(statement)
                while at >= 0:
                    line = lines[bisect.bisect_right(starts, at)]
                    found.append((os.path.relpath(path, dest), line.strip()))
                    at = squeezed.find(statement, at + 1)
    return sorted(set(found))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m course.instructors.release DEST")
    written = release(sys.argv[1])
    found = leaks(sys.argv[1])
    if found:
        raise SystemExit("solution lines in the release:\n" + "\n".join(f"  {p}: {line}" for p, line in found))
    print(f"wrote {len(written)} files to {sys.argv[1]}; no solution line among them")
