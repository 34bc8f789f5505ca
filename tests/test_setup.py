"""Set-up (course/setup.py): it runs on the student's own Python, on any system, before anything is installed."""

import ast
import os
import re
import subprocess
import sys

import pytest

from course import setup
from course.student import ROOT


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
    assert "needs Python 3.10 or newer; /usr/bin/python3 is Python 3.9.6" in problem and "python3.10 -m course setup" in problem


def test_setup_stops_on_an_old_python_before_making_anything(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "version_info", (3, 9, 6, "final", 0))
    with pytest.raises(SystemExit, match=r"needs Python 3\.10 or newer.* is Python 3\.9\.6"):
        setup.setup(venv_dir=str(tmp_path / ".venv"))
    assert not os.path.exists(tmp_path / ".venv")


def test_old_pythons_can_read_it():
    """Python 3.6 must reach the version check, so the file may use nothing newer than 3.6's syntax."""
    with open(setup.__file__) as f:
        ast.parse(f.read(), feature_version=(3, 6))


def test_stdlib_only():
    """It runs before anything is installed: a Python without torch or pytest must import it."""
    done = subprocess.run([sys.executable, "-S", "-c", "import course.setup"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_levels_build_on_each_other():
    """Each requirements file includes the level before it, so a level installs everything below it."""
    files = [setup.REQUIREMENTS[level] for level in setup.LEVELS]
    for below, above in zip(files, files[1:]):
        with open(os.path.join(ROOT, above)) as f:
            assert f"-r {below}" in f.read().splitlines(), f"{above} should start from {below}"
    with open(os.path.join(ROOT, files[0])) as f:
        students = f.read()
    assert not re.search(r"^(jupyter|nbgrader|notebook)", students, re.M), "students on the .py path need no notebook packages"
