"""The graded checks and their points: the one table that `make grade` and the notebooks both use.

A check of exercise N is a function ``test_*`` of ``checks/test_exNN_*.py`` that carries its points,
an integer, as a pytest mark: ``@pytest.mark.points(5)``. A check parametrized over world sizes
(``@pytest.mark.parametrize``) has one case per parameter, each worth its points, named as pytest
names it (``test_by_row[2]``). An exercise's points are the sum over its cases. A check marked
``scaffold`` tests code the course gives, and earns nothing.

`make grade` runs each case as a pytest item (course/grading/plugin.py reads the mark from the item); a
notebook's graded cell ``grade(test_by_row)`` runs every case of the check in turn and earns the
same points (course/grading/in_notebook.py), so that both paths give one grade.
"""

from __future__ import annotations

import importlib
import itertools
from dataclasses import dataclass, field

from course.exercises import EXERCISES, of_checks
from course.layout import graded_exercises


@dataclass(frozen=True)
class Case:
    """One graded run of a check: what `make grade` runs as one pytest item."""

    exercise: int
    test: str  # the check's function, "test_by_row"
    name: str  # as pytest names the item, "test_by_row[2]"
    params: dict = field(default_factory=dict)  # its keyword arguments besides impl_dir
    points: int = 0


def _marks(fn) -> list:
    return list(getattr(fn, "pytestmark", []))


def _id(value) -> str:
    """pytest's id of one parameter value (the ints, strings and tuples of these tests)."""
    if isinstance(value, (tuple, list)):
        return "-".join(_id(v) for v in value)
    return str(value)


def points_of(marks) -> int | None:
    """The points of a check from its marks (the closest first); None when it has none."""
    mark = next((m for m in marks if m.name == "points"), None)
    if mark is None:
        return None
    points = mark.args[0]
    if not isinstance(points, int) or isinstance(points, bool) or points < 1:
        raise ValueError(f"points must be a whole number of at least 1, got {points!r}")
    return points


def exercise_of_module(module: str) -> int:
    """The exercise of a checks module, checks.test_exNN_name."""
    return of_checks(module.replace(".", "/") + ".py").number


def cases(fn) -> list:
    """The cases of a check function, in pytest's order, with their points (its mark, or a
    pytest.param's own). Raises ValueError for a check without points."""
    marks = _marks(fn)
    if any(m.name == "scaffold" for m in marks):
        return []
    exercise = exercise_of_module(fn.__module__)
    default = points_of(marks)
    parametrize = [m for m in marks if m.name == "parametrize"]
    if len(parametrize) > 1:
        raise ValueError(f"{fn.__name__}: one parametrize mark at most, so that its cases read as pytest's")
    if not parametrize:
        if default is None:
            raise ValueError(f"{fn.__module__}.{fn.__name__} has no points: mark it @pytest.mark.points(N)")
        return [Case(exercise, fn.__name__, fn.__name__, {}, default)]
    names, values = parametrize[0].args[:2]
    names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    ids = parametrize[0].kwargs.get("ids")
    if ids is not None and not isinstance(ids, (list, tuple)):
        raise ValueError(f"{fn.__name__}: ids given as a list, so that its cases read as pytest's")
    found = []
    for i, value in enumerate(values):
        own_marks, own_id = list(getattr(value, "marks", ())), getattr(value, "id", None) or (ids and ids[i])
        if hasattr(value, "values"):  # pytest.param(...): its values, marks and id
            value = value.values if len(names) > 1 else value.values[0]
        params = dict(zip(names, value)) if len(names) > 1 else {names[0]: value}
        points = points_of(own_marks) or default
        if points is None:
            raise ValueError(f"{fn.__module__}.{fn.__name__} has no points: mark it @pytest.mark.points(N)")
        found.append(Case(exercise, fn.__name__, f"{fn.__name__}[{own_id or _id(value)}]", params, points))
    return found


def modules() -> list:
    """The checks modules there are, checks.test_exNN_name, by exercise."""
    return [e.checks_module for e in EXERCISES if e.number in graded_exercises()]


def of_module(module: str) -> list:
    """Every case of every check of one check module, in its order."""
    loaded = importlib.import_module(module)
    functions = [f for name, f in vars(loaded).items() if name.startswith("test_") and callable(f)]
    functions.sort(key=lambda f: f.__code__.co_firstlineno)
    return list(itertools.chain.from_iterable(cases(f) for f in functions))


def points() -> dict:
    """Each exercise's points: the sum over its checks' cases (imports the check modules)."""
    total: dict = {}
    for module in modules():
        for case in of_module(module):
            total[case.exercise] = total.get(case.exercise, 0) + case.points
    return total


class Said(str):
    """A check's sentence, and the mistake it diagnosed in a few words: the concept that titles a
    row of the class report (course/instructors/report.py) and tells two diagnoses of one assert apart."""

    concept: str = ""


def said(concept: str, sentence: str) -> Said:
    """``assert ok, said("gradients summed, not averaged", f"rank {r}'s gradient ...")``"""
    found = Said(sentence)
    found.concept = concept
    return found


def concept_of(error: BaseException, frame) -> str:
    """What a failed assert judged: its Said's concept, else the first sentence of the docstring of
    the check function it is in (frame: that function's frame), else ''."""
    given = getattr(error.args[0], "concept", "") if error.args else ""
    if given:
        return given
    function = frame.f_globals.get(frame.f_code.co_name) if frame is not None else None
    doc = (getattr(function, "__doc__", None) or "").strip()
    return doc.split("\n\n")[0].split(". ")[0].replace("\n", " ").rstrip(".") if doc else ""
