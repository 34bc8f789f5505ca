"""Which implementation of the exercises is under test, and how to load it.

One switch, COURSE_IMPL, selects it for the whole test suite and for every worker process:
``solutions`` (the reference, the default), ``student`` (the top-level files), or the path of a
folder holding the student files of course/layout.py (a submission, or a mutant made by the tests).

Modules are loaded from that folder by path and never left in sys.modules, so a worker that is
handed a folder loads exactly that folder's code. The exercise checks call load() only in their
worker processes: the process that grades never runs the code under test (checks/helpers.py).
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

from course.exercises import STUDENT_MODULES as MODULES
from course.layout import ROOT, SOLUTIONS

_loaded: dict = {}
_refused = False
_judging = False  # a reference world imports the judge's reference code: its own names, allowed


def judge() -> str | None:
    """The reference solutions that a judge computes its answers with where the grade counts, on cases drawn
    as it grades (checks/helpers.py's judged()): the folder COURSE_JUDGE names (Gradescope's autograder
    keeps them there, out of every submission's reach), else solutions/ in the instructors' repository;
    None in the students' copy, which holds none. Only a reference world loads them."""
    folder = os.path.abspath(os.environ.get("COURSE_JUDGE") or SOLUTIONS)
    return folder if os.path.isfile(os.path.join(folder, "mlp.py")) else None


def selected(default: str | None = None) -> str:
    """The folder named by COURSE_IMPL (absolute). When it is not set, `default`; without one, the
    reference solutions where there are some (the instructors' repository), else the student files
    (the students' copy, where the benchmarks then measure the student's own code)."""
    choice = os.environ.get("COURSE_IMPL") or default or ("solutions" if os.path.isdir(SOLUTIONS) else "student")
    if choice == "solutions":
        return SOLUTIONS
    if choice == "student":
        return ROOT
    return os.path.abspath(choice)


class NotImportable(ImportError):
    """Raised by any use of a student file that does not import; ``unimportable`` holds which file and
    which error, as fields (course/runtime/failure.py carries them to the grader)."""

    def __init__(self, file: str, error: BaseException):
        super().__init__(f"{file} does not import: {type(error).__name__}: {error}")
        self.unimportable = {"file": file, "error": type(error).__name__}


class Unimportable:
    """Stands in for a module that does not import: any use of it raises the reason.

    One broken file then fails only the exercises that use it (mydp.py imports mlp.py, so a
    syntax error in mlp.py fails exercises 1, 3 and 4, and exercise 2 is still graded).
    """

    def __init__(self, name: str, error: BaseException):
        self.name, self.error = name, error

    def __getattr__(self, attribute):
        raise NotImportable(f"{self.name}.py", self.error) from self.error


def _import(folder: str, name: str):
    if not os.path.isfile(os.path.join(folder, f"{name}.py")):
        return Unimportable(name, FileNotFoundError(f"there is no {name}.py in {folder}"))
    try:
        return importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - whatever a submission raises at import time
        return Unimportable(_culprit(folder, name, error), error)


def _culprit(folder: str, name: str, error: BaseException) -> str:
    """The student file whose code raised: mydp.py's `from mlp import` of an mlp.py with a syntax error
    is mlp.py's mistake, and its message says so."""
    # The innermost first: a syntax error's file, then the frames from the deepest out.
    files = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(error.__traceback__)][::-1]
    if isinstance(error, SyntaxError) and error.filename:
        files.insert(0, error.filename)
    for file in files:
        module = os.path.splitext(os.path.basename(file))[0]
        if module in MODULES and os.path.dirname(os.path.abspath(file)) == folder:
            return module
    return name


class Modules:
    """The student modules of one folder, one attribute per student file (.mlp, .dist, ...), each imported
    from that folder when first used: a probe of exercise 16 reads nd.py (and what it imports), not the
    other fifteen files (each call of a kept world reads them again: 30 to 80 ms a rank for all of them).
    mydp's `from mlp import` finds this folder's mlp, the same module as .mlp."""

    def __init__(self, folder: str):
        self._folder, self._modules = folder, {}

    def __getattr__(self, name: str):
        if name not in MODULES:
            raise AttributeError(f"there is no student file {name}.py")
        if name not in self._modules:
            self._import(name)
        return self._modules[name]

    def __dir__(self):
        return [*super().__dir__(), *MODULES]

    def _import(self, name: str) -> None:
        saved_path = list(sys.path)
        saved_modules = {other: sys.modules.pop(other) for other in MODULES if other in sys.modules}
        sys.modules.update({other: m for other, m in self._modules.items() if not isinstance(m, Unimportable)})
        sys.path.insert(0, self._folder)
        global _judging
        _judging = _refused  # a refusing process loads the judge's folder only (load())
        try:
            self._modules[name] = _import(self._folder, name)
            for other in MODULES:  # what it imported of this folder's files: the same modules from now on
                if other not in self._modules and other in sys.modules:
                    self._modules[other] = sys.modules[other]
        finally:
            _judging = False
            for other in MODULES:
                sys.modules.pop(other, None)
            sys.modules.update(saved_modules)
            sys.path[:] = saved_path


def load(folder: str) -> Modules:
    """The student modules of one folder (Modules: each imported when first used). A reference world loads
    the judge's reference solutions only (judge())."""
    folder = os.path.abspath(folder)
    if _refused and folder != judge():
        raise RuntimeError("a reference world runs no code under test: its probe may load() the judge's folder only")
    if folder not in _loaded:
        _loaded[folder] = Modules(folder)
    return _loaded[folder]


class _Refused:
    """A finder that refuses the student files' module names, wherever they would be found."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in MODULES and not _judging:
            raise ImportError(f"a reference world runs no code under test: {name} may not be imported")
        return None


def refuse() -> None:
    """From now on this process loads no code under test: load() raises for any folder but the judge's, and so
    does importing a module named as a student file outside it (a reference world's workers, course/runtime/workers.py: what a judge compares with is computed
    where no submission ran, so no submission's patch of torch or of the checks can forge it)."""
    global _refused
    _refused = True
    sys.meta_path.insert(0, _Refused())


def loaded() -> list:
    """The folders whose modules load() holds."""
    return list(_loaded)


def forget(folder: str) -> None:
    """Drop what load() keeps of a folder, so the next load reads its files again (after an edit)."""
    _loaded.pop(os.path.abspath(folder), None)
