"""The layout holds: every exercise is one entry of course/exercises.py and its own files, no other
list names the exercises, and course/ is in layers that import only downwards (docs/design.md, "How
the repository is laid out")."""

import ast
import os
import re

import pytest

from course.exercises import EXERCISES, STUDENT_FILES, STUDENT_MODULES
from course.layout import ROOT, released_files

# course/'s layers, lowest first: a module imports only from its own layer or one below it.
LAYERS = (
    (
        "base",
        (
            "course",
            "course.exercises",
            "course.kinds",
            "course.layout",
            "course.device",
            "course.impl",
            "course.timeline",
        ),
    ),
    ("runtime", ("course.runtime",)),
    ("student API", ("course.launch", "course.flags", "course.memory")),
    ("grading", ("course.grading",)),
    ("instructors", ("course.instructors",)),
    ("entry points", ("course.__main__", "course.setup")),
)


def layer_of(module: str) -> int:
    """The layer of a module of course/: that of the longest prefix of its name that LAYERS names."""
    found = [
        (len(prefix), height)
        for height, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    if not found or max(found)[0] == len("course") and module != "course":
        raise AssertionError(f"{module} is in no layer: add it to LAYERS and to docs/design.md")
    return max(found)[1]


def course_modules() -> dict:
    """module name -> path, for every module of course/."""
    found = {}
    for top, dirs, files in os.walk(os.path.join(ROOT, "course")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(top, name)
                module = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".").removesuffix(".__init__")
                found[module] = path
    return found


def imports(path: str, module: str, top_level_only: bool = False) -> set:
    """The modules of course/, checks/ and tests/ that a file imports (inside functions too, unless top_level_only)."""
    tree = ast.parse(open(path).read())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative
                base = ".".join(module.split(".")[: -node.level] + [node.module])
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m.split(".")[0] in ("course", "checks", "tests")}


def test_every_module_of_course_is_in_a_layer_and_imports_only_downwards():
    modules = course_modules()
    upward = []
    for module, path in modules.items():
        for imported in imports(path, module):
            if imported.split(".")[0] != "course":
                upward.append(f"{module} imports {imported}: course/ imports nothing of the checks or the tests")
            elif imported in modules and layer_of(imported) > layer_of(module):
                upward.append(
                    f"{module} ({LAYERS[layer_of(module)][0]}) imports {imported} ({LAYERS[layer_of(imported)][0]})"
                )
    assert not upward, "\n".join(upward)


def test_the_modules_of_course_import_each_other_without_a_cycle():
    modules = course_modules()
    graph = {m: {i for i in imports(p, m, top_level_only=True) if i in modules and i != m} for m, p in modules.items()}
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError("an import cycle: " + " -> ".join(path[path.index(module) :] + [module]))
        if module in done:
            return
        path.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_the_instructors_tools_are_a_folder_the_students_copy_leaves_out():
    released = released_files(ROOT)
    assert not [p for p in released if p.startswith(os.path.join("course", "instructors"))]
    assert not [p for p in released if p.startswith("tests" + os.sep) or p.startswith("solutions" + os.sep)]
    checks = sorted(p for p in os.listdir(os.path.join(ROOT, "checks")) if p.endswith(".py"))
    assert [p for p in released if p.startswith("checks" + os.sep)] == [os.path.join("checks", p) for p in checks]


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.slug)
def test_every_exercise_has_its_files(exercise):
    """What one entry of course/exercises.py stands for is there: the rest of the course finds it by the entry."""
    for path in (exercise.handout, exercise.notebook, exercise.notebook_source, exercise.checks):
        assert os.path.isfile(os.path.join(ROOT, path)), f"exercise {exercise.number}: no {path}"
    assert os.path.isfile(os.path.join(ROOT, "solutions", exercise.file)), f"no solutions/{exercise.file}"
    mutants = os.path.join(ROOT, "tests", "mutants", f"test_ex{exercise.slug}.py")
    assert os.path.isfile(mutants), (
        f"exercise {exercise.number}: its mutants belong in {os.path.relpath(mutants, ROOT)}"
    )
    for script in exercise.demo:
        assert script.split()[0] == exercise.file or script.split()[0] in STUDENT_FILES, script


def _names_of_exercises(strings: list) -> set:
    """Which of the exercises' names a list of strings holds: student files, their modules, check modules."""
    names = set(STUDENT_FILES) | set(STUDENT_MODULES) | {e.checks_module.split(".")[-1] for e in EXERCISES}
    return {s for s in strings if s in names}


def _lists(path: str) -> list:
    """Each literal list, tuple, set or dict of a Python file, as (line, its strings)."""
    tree = ast.parse(open(path).read())
    found = []
    for node in ast.walk(tree):
        items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict)) and items:
            strings = [n.value for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            found.append((node.lineno, strings))
    return found


def test_no_list_outside_the_registry_names_the_exercises():
    """Adding an exercise is its own files and one entry of course/exercises.py: no other list of the
    course's code, its checks, its tests or its build names half of the student files or more (a list
    that does is a list of the exercises, to be kept by hand; a few, chosen, are a test's choice)."""
    most = len(STUDENT_FILES) // 2
    where = []
    for folder in ("course", "checks", "tests", "bench"):
        for top, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                path = os.path.join(top, name)
                if not name.endswith(".py") or path == os.path.join(ROOT, "course", "exercises.py"):
                    continue
                for line, strings in _lists(path):
                    named = _names_of_exercises(strings)
                    if len(named) >= most:
                        where.append(f"{os.path.relpath(path, ROOT)}:{line} names {sorted(named)}")
    for build in ("Makefile", "pyproject.toml", ".ci/run"):
        with open(os.path.join(ROOT, build)) as f:
            named = {n for n in STUDENT_FILES if re.search(rf"(?<![\w/]){re.escape(n)}", f.read())}
        if len(named) >= most:
            where.append(f"{build} names {sorted(named)}")
    assert not where, "lists of exercises outside course/exercises.py:\n" + "\n".join(where)
