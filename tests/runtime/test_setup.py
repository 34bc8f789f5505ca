"""Set-up (course/setup.py): it runs on the student's own Python, on any system, before anything is installed."""

import ast
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from course import setup
from course.instructors.student import ROOT


def test_venv_python_per_system():
    assert setup.venv_python(".venv", "win32") == os.path.join(".venv", "Scripts", "python.exe")
    assert setup.venv_python(".venv", "linux") == os.path.join(".venv", "bin", "python")
    assert setup.venv_python(".venv", "darwin") == os.path.join(".venv", "bin", "python")
    assert setup.activate_command("win32") == r".venv\Scripts\activate"
    assert setup.activate_command("darwin") == ". .venv/bin/activate"


def test_python_version_is_checked_against_pyproject():
    assert setup.needed_python() == (3, 10)
    assert setup.version_problem((3, 10, 0)) is None and setup.version_problem((3, 13, 1)) is None
    problem = setup.version_problem((3, 9, 6), executable="/usr/bin/python3")
    assert "\n" not in problem
    assert (
        "needs Python 3.10 or newer; /usr/bin/python3 is Python 3.9.6" in problem
        and "python3.10 -m course setup" in problem
    )


def test_setup_stops_on_an_old_python_before_making_anything(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "version_info", (3, 9, 6, "final", 0))
    with pytest.raises(SystemExit, match=r"needs Python 3\.10 or newer.* is Python 3\.9\.6"):
        setup.setup(venv_dir=str(tmp_path / ".venv"))
    assert not os.path.exists(tmp_path / ".venv")


@pytest.mark.parametrize("name", ["setup.py", "__main__.py", "__init__.py"])
def test_old_pythons_can_read_it(name):
    """Python 3.6 must reach the version check through `python3 -m course setup`, so these files may
    use nothing newer than 3.6's syntax, nor a __future__ feature that 3.6 does not know."""
    with open(os.path.join(ROOT, "course", name)) as f:
        tree = ast.parse(f.read(), feature_version=(3, 6))
    futures = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "__future__"
        for alias in node.names
    }
    assert not futures - {"print_function", "division", "absolute_import", "generators"}, futures


def _old_python():
    """A Python older than the course needs, if this machine has one (pyenv's, or on PATH)."""
    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.[6-9].*/bin/python")))
    found += [shutil.which(f"python3.{minor}") for minor in range(6, 10)]  # a pyenv shim may not run: tried
    runs = (path for path in found if path and subprocess.run([path, "-c", ""], capture_output=True).returncode == 0)
    return next(runs, None)


def test_an_old_python_gets_the_one_line():
    old = _old_python()
    if old is None:
        pytest.skip("no Python older than 3.10 on this machine")
    done = subprocess.run([old, "-m", "course", "setup"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.startswith("The course needs Python 3.10 or newer"), done.stderr


def test_stdlib_only():
    """It runs before anything is installed: a Python without torch or pytest must import it."""
    done = subprocess.run(
        [sys.executable, "-S", "-c", "import course.setup, course.__main__"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_levels_build_on_each_other():
    """Each requirements file includes the level before it, so a level installs everything below it."""
    files = [setup.REQUIREMENTS[level] for level in setup.LEVELS]
    for below, above in zip(files, files[1:]):
        with open(os.path.join(ROOT, above)) as f:
            assert f"-r {below}" in f.read().splitlines(), f"{above} should start from {below}"
    with open(os.path.join(ROOT, files[0])) as f:
        students = f.read()
    assert not re.search(r"^(jupyter|nbgrader|notebook)", students, re.M), (
        "students on the .py path need no notebook packages"
    )


def test_grading_outside_the_course_environment_says_to_activate_it(tmp_path):
    """Issue 29: `python3 -m course grade` with a Python that has no torch printed pytest's
    ImportError of conftest.py (exit 4). It says, in one line, what to do."""
    python = os.path.join(sys.base_prefix, "bin", "python3")  # the interpreter beneath the venv
    has_torch = subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0
    if not os.path.exists(python) or has_torch:
        pytest.skip("no Python without torch here")
    done = subprocess.run(
        [python, "-m", "course", "grade", "--ex", "2"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == (
        f"torch is not installed for {python}: activate the course's environment first"
        f" ({setup.activate_command()}), or run make grade"
    )
