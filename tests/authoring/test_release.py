"""Instructors only: the students' copy holds no statement of a solution, in any file, and every
command and link it names works in it."""

import json
import os
import re
import subprocess
import sys

import pytest

from course.instructors.release import (
    INSTRUCTORS_BEGIN,
    INSTRUCTORS_END,
    for_students,
    leaks,
    release,
    secret_lines,
    squeeze,
    text_lines,
)
from course.setup import REQUIREMENTS, ROOT

HOOK = "param.register_post_accumulate_grad_hook(partial(self._gradient_ready, bucket))"  # solutions/mydp.py


def test_leak_check_finds_solution_statements_in_handouts_and_notebooks(tmp_path):
    dest = tmp_path / "release"
    release(str(dest))
    assert leaks(str(dest)) == []
    assert squeeze(HOOK) in secret_lines()
    assert squeeze("rank, world_size = dist.get_rank(), dist.get_world_size()") not in secret_lines(), (
        "a line that also stands outside the solution regions is given to students anyway"
    )

    handout = dest / "exercises" / "06_overlap.md"
    original = handout.read_text()
    respaced = "Register `param.register_post_accumulate_grad_hook( partial(self._gradient_ready,bucket) )` on each."
    handout.write_text(original + respaced + "\n")
    assert leaks(str(dest)) == [("exercises/06_overlap.md", respaced)], (
        "a solution statement with other spacing, inside prose"
    )
    wrapped = ["Then `param.register_post_accumulate_grad_hook(partial(", "self._gradient_ready, bucket))` and done."]
    handout.write_text(original + "\n".join(wrapped) + "\n")
    assert leaks(str(dest)) == [("exercises/06_overlap.md", wrapped[0])], "a solution statement wrapped over two lines"
    handout.write_text(original)

    notebook = dest / "exercises" / "03_ddp.ipynb"
    nb = json.loads(notebook.read_text())
    answer = "R means, which is the mean gradient over all R x B rows: the step one process would take on a"  # the model answer of solutions/notebooks/03_ddp.md
    nb["cells"].append({"cell_type": "markdown", "id": "leak", "metadata": {}, "source": [f"Hint: {answer} batch.\n"]})
    notebook.write_text(json.dumps(nb))
    assert leaks(str(dest)) == [("exercises/03_ddp.ipynb", f"Hint: {answer} batch.")], (
        "a model answer in a released notebook"
    )


# Commands as the copy's text names them: inside `backticks`, or on a line of a code block.
MAKE = re.compile(r"\bmake ([a-z][\w-]*)")
SCRIPT = re.compile(r"\bpython3? ((?:[\w./-]+/)?\w+\.py)\b")
MODULE = re.compile(r"\bpython3? -m ([\w.]+)")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
# A file named by its path in the repository (`checks/test_ex01_mlp.py`, bench/pp.json); not a
# pattern (exercises/*.ipynb) or a placeholder in capitals (bench/NAME.json).
CITED = re.compile(r"(?<![\w./*-])((?:[\w-]+/)+[\w.-]*\w\.[a-z]+)\b(?![/*])")
# The flags that set-up is told to run with, as far as a backtick or a comment.
SETUP = re.compile(r"\bpython3? -m course setup([^`#\n]*)")
# Modules of Python or of requirements.txt, not of the course.
INSTALLED = {"pytest", "pip", "venv", "jupyter", "torch.distributed.run", "nbgrader"}


# make as a student runs it, not nested in `make test`'s (which would print "Entering directory").
NOT_NESTED = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}


def commands_of(text: str, markdown: bool) -> list:
    """The command-like snippets of a text: its `spans`, and a markdown text's code lines."""
    snippets, fenced = re.findall(r"`([^`\n]+)`", text), False
    for line in text.splitlines() if markdown else ():
        if line.strip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            snippets.append(line)
    return snippets


def test_every_command_and_link_in_the_students_copy_works_there(tmp_path):
    """What the copy's README, handouts, notebooks, docs and code tell a student to run or read is there."""
    dest = tmp_path / "release"
    release(str(dest))
    targets, flags, missing = set(), set(), []
    folders = {p.name for p in dest.iterdir() if p.is_dir()} | {p.name for p in os.scandir(ROOT) if p.is_dir()}
    for path in sorted(p for p in dest.rglob("*") if p.is_file() and p.suffix in (".md", ".ipynb", ".py", "")):
        text = "\n".join(text_lines(str(path)))
        where = path.relative_to(dest)
        flags.update(flag for found in SETUP.findall(text) for flag in re.findall(r"--[\w-]+", found))
        for snippet in commands_of(text, path.suffix in (".md", ".ipynb")):
            targets.update(MAKE.findall(snippet))
            for script in SCRIPT.findall(snippet):
                if not (dest / script).exists() and not (dest / "bench" / script).exists():
                    missing.append(f"{where}: python {script}")
            for module in MODULE.findall(snippet):
                parts = module.split(".")
                found = (dest.joinpath(*parts).with_suffix(".py")).exists() or (
                    dest.joinpath(*parts) / "__main__.py"
                ).exists()
                if not found and module not in INSTALLED:
                    missing.append(f"{where}: python -m {module}")
        if path.suffix == ".md":
            for link in LINK.findall(text):
                if "://" not in link and not link.startswith("mailto:") and not (path.parent / link).exists():
                    missing.append(f"{where}: link {link}")
            for cited in CITED.findall(text):
                parts = cited.split("/")
                placeholder = any(part.split(".")[0].isupper() for part in parts)
                if parts[0] in folders and not placeholder and not (dest / cited).exists():
                    missing.append(f"{where}: {cited}")
    offered = subprocess.run(
        [sys.executable, "-m", "course", "setup", "--help"], cwd=dest, capture_output=True, text=True, timeout=60
    )
    offered = set(re.findall(r"--[\w-]+", offered.stdout)) - {"--help"}
    assert "--notebooks" in offered, offered
    for flag in sorted(flags | offered):
        requirements = REQUIREMENTS.get(flag[2:], "")
        if flag not in offered:
            missing.append(f"python -m course setup {flag}: not a flag of this copy's set-up")
        elif requirements and not (dest / requirements).exists():
            missing.append(f"python -m course setup {flag}: this copy has no {requirements}")
    assert {"grade", "setup", "bench-zero", "test"} <= targets
    for target in sorted(targets):
        dry = subprocess.run(
            ["make", "-n", target], cwd=dest, env=NOT_NESTED, capture_output=True, text=True, timeout=60
        )
        if dry.returncode != 0 or "Nothing to be done" in dry.stdout + dry.stderr:  # a phony name, no rule
            missing.append(f"make {target}: {(dry.stderr or dry.stdout).strip()}")
    assert not missing, "\n".join(missing)
    readme = (dest / "README.md").read_text()
    assert INSTRUCTORS_BEGIN not in readme and "make autograde" not in readme and "make release" not in readme
    helped = subprocess.run(["make", "help"], cwd=dest, env=NOT_NESTED, capture_output=True, text=True, timeout=60)
    assert "make grade" in helped.stdout and "make release" not in helped.stdout, helped.stdout
    assert "autograde" not in helped.stdout, helped.stdout
    refused = subprocess.run(
        [sys.executable, "-m", "course", "setup", "--instructors"], cwd=dest, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode != 0 and refused.stderr.strip() == (
        "--instructors is for the instructors' repository: this copy of the course has no requirements-instructors.txt"
    ), refused.stdout + refused.stderr
    assert not (dest / ".venv").exists(), "refused before anything was made"


def test_the_readme_loses_only_its_instructors_parts():
    readme = f"intro\n\n{INSTRUCTORS_BEGIN}\nmake release\n{INSTRUCTORS_END}\n\nmore\n{INSTRUCTORS_BEGIN}\nx\n{INSTRUCTORS_END}\nend\n"
    assert for_students(readme) == "intro\n\nmore\nend\n"
    with pytest.raises(ValueError, match="without"):
        for_students(f"intro\n{INSTRUCTORS_BEGIN}\nnever closed\n")
