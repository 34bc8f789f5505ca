"""Which implementation of the exercises is under test, and how to load it.

One switch, COURSE_IMPL, selects it for the whole test suite and for every worker process:
``solutions`` (the reference, the default), ``student`` (the top-level files), or the path of a
folder holding mlp.py, dist.py and mydp.py (a submission, or a mutant made by the tests).

Modules are loaded from that folder by path and never left in sys.modules, so several
implementations can be loaded in one process side by side (the mutant tests do), and a worker
that is handed a folder loads exactly that folder's code.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace

from course.student import ROOT, SOLUTIONS, STUDENT_FILES

MODULES = tuple(name[: -len(".py")] for name in STUDENT_FILES)
_loaded: dict = {}


def selected() -> str:
    """The folder named by COURSE_IMPL (absolute)."""
    choice = os.environ.get("COURSE_IMPL", "solutions")
    if choice == "solutions":
        return SOLUTIONS
    if choice == "student":
        return ROOT
    return os.path.abspath(choice)


def load(folder: str) -> SimpleNamespace:
    """The modules mlp, dist and mydp of one folder; mydp's `from mlp import` finds that folder's mlp."""
    folder = os.path.abspath(folder)
    if folder in _loaded:
        return _loaded[folder]
    saved_path = list(sys.path)
    saved_modules = {name: sys.modules.pop(name) for name in MODULES if name in sys.modules}
    sys.path.insert(0, folder)
    try:
        modules = SimpleNamespace(**{name: importlib.import_module(name) for name in MODULES})
    finally:
        for name in MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved_modules)
        sys.path[:] = saved_path
    _loaded[folder] = modules
    return modules
