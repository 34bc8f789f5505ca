"""Instructors only: every judge validates what a worker sent before it reads it (issue 36).

A worker runs the submission, which can rewrite what the worker sends back: an empty list where the
probe failed passed every judge written as `for case, got in zip(CASES, result)`. So a judge never
reads a result that checks/helpers.py's validation has not checked against the shape the judge asked
for: world(), alone() and reference_world() are the only ways to run a probe, and each call says its
shape (expect=). The walk below proves it of the check sources, as tests/grading/test_report.py's walks prove their titles.
"""

import ast

from tests.grading.test_report import check_sources

# The launcher's functions that run a probe and hand back what its workers sent, unchecked.
LAUNCHERS = {"run", "launch"}
# checks/helpers.py's functions that run a probe and validate what it returned.
READERS = {"world", "alone", "reference_world"}


def _name(call) -> str:
    return call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")


def _launches(call) -> bool:
    """A call of the launcher: run(...), or launch.run(...), workers.run(...) (a probe's pipeline.run() is not)."""
    if isinstance(call.func, ast.Name):
        return call.func.id in LAUNCHERS
    owner = getattr(call.func, "value", None)
    return _name(call) in LAUNCHERS and isinstance(owner, ast.Name) and owner.id in ("launch", "workers")


def _functions(tree):
    return [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)]


def _passes_expect_on(function, readers) -> bool:
    """Whether function calls a reader with expect= one of its own parameters: it is a reader too."""
    parameters = {a.arg for a in function.args.args + function.args.kwonlyargs}
    return any(
        isinstance(node, ast.Call)
        and _name(node) in readers
        and any(k.arg == "expect" and isinstance(k.value, ast.Name) and k.value.id in parameters for k in node.keywords)
        for node in ast.walk(function)
    )


def unvalidated(sources: dict) -> list:
    """The places of the check sources ({module: source}, 'helpers' among them) where a worker's result could
    reach a judge unchecked: a launcher imported or called outside helpers' readers, a reader's call of a launcher
    whose result is not the first argument of validated(), a call of a reader (or of a function that passes its
    expect on to one) without expect=, or with expect=object (anything at all)."""
    trees = {module: ast.parse(source) for module, source in sources.items()}
    readers, grown = set(READERS), True
    while grown:
        found = {f.name for tree in trees.values() for f in _functions(tree) if _passes_expect_on(f, readers)}
        grown = not found <= readers
        readers |= found
    places = []
    for module, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module in ("course.launch", "course.runtime.workers"):
                taken = sorted(a.name for a in node.names if a.name in LAUNCHERS)
                if taken and module != "helpers":
                    places.append(f"{module}: imports {', '.join(taken)} from {node.module}")
        for function in _functions(tree):
            validated = {
                id(node.args[0])
                for node in ast.walk(function)
                if isinstance(node, ast.Call) and _name(node) == "validated" and node.args
            }
            for node in ast.walk(function):
                if not isinstance(node, ast.Call):
                    continue
                where = f"{module}.{function.name}"
                name = _name(node)
                if _launches(node):
                    if not (module == "helpers" and function.name in READERS and id(node) in validated):
                        places.append(f"{where}: calls {name}() and reads what the workers sent unchecked")
                elif name in readers:
                    expect = next((k.value for k in node.keywords if k.arg == "expect"), None)
                    if expect is None:
                        places.append(f"{where}: calls {name}() without expect=")
                    elif isinstance(expect, ast.Name) and expect.id == "object":
                        places.append(f"{where}: calls {name}() with expect=object, which checks nothing")
    return sorted(set(places))


def test_every_judge_validates_what_a_worker_sent():
    """Issue 36: untouched stubs and a worker that sent an empty list where it failed scored 71/370. Every
    result a judge reads comes through world() or alone(), which check it against the judge's expect=."""
    found = unvalidated(check_sources())
    assert not found, f"read a worker's result through world() or alone() with expect= its shape: {found}"


def test_the_unvalidated_are_found():
    """The walk finds what it looks for: a reader that does not validate, a call without expect= or with
    expect=object, a pass-through whose caller gives none, the launcher imported and called by a check;
    and it passes a call with a shape."""
    helpers = """
from course.launch import run
def world(fn, n, *args, expect):
    return validated(run(fn, n, *args), expect, n)
def alone(fn, *args, expect):
    return run(fn, 1, *args)[0]
"""
    checks = """
from course.launch import run
from checks.helpers import world
def through(fn, *args, expect):
    return world(fn, 2, *args, expect=expect)
def check_a(folder):
    return world(probe, 2, folder)
def check_b(folder):
    return world(probe, 2, folder, expect=object)
def check_c(folder):
    return through(probe, folder)
def check_d(folder):
    return run(probe, 2, folder), launch.run(probe, 2, folder), pipeline.run(events)
def check_e(folder):
    return world(probe, 2, folder, expect=many(int, 3)), through(probe, folder, expect=int)
"""
    assert unvalidated({"helpers": helpers, "test_ex00_x": checks}) == [
        "helpers.alone: calls run() and reads what the workers sent unchecked",
        "test_ex00_x.check_a: calls world() without expect=",
        "test_ex00_x.check_b: calls world() with expect=object, which checks nothing",
        "test_ex00_x.check_c: calls through() without expect=",
        "test_ex00_x.check_d: calls run() and reads what the workers sent unchecked",
        "test_ex00_x: imports run from course.launch",
    ]


# --- references: computed where no submission ran (issue 36) -------------------------------------
# A probe that world() or alone() runs shares its kept world with the submission that the world loaded:
# one that loads no code under test computes a reference (torch's own DDP, ...), which a submission that
# patched torch or the checks there would forge. It belongs in reference_world(), whose workers refuse to
# load any (course/impl.py's refuse()).
SUBMISSION_WORLDS = {"world", "alone", "on_pipeline"}


def _loads(name: str, functions: dict, seen: set) -> bool:
    """Whether the function of that name (in functions: {name: FunctionDef}) loads the code under test: calls
    load(), or names a function that does (a lambda, a table of them, a helper)."""
    if name in seen or name not in functions:
        return False
    seen.add(name)
    for node in ast.walk(functions[name]):
        if isinstance(node, ast.Call) and _name(node) == "load":
            return True
        if isinstance(node, ast.Name) and _loads(node.id, functions, seen):
            return True
    return False


def probes_without_submission(sources: dict) -> list:
    """The probes that a submission's world runs (the first argument of world(), alone() or on_pipeline(), a
    function of the module or of helpers) and that load no code under test: references in the wrong world."""
    trees = {module: ast.parse(source) for module, source in sources.items()}
    shared = {f.name: f for f in _functions(trees["helpers"])}
    places = []
    for module, tree in trees.items():
        functions = shared | {f.name: f for f in _functions(tree)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _name(node) in SUBMISSION_WORLDS and node.args:
                probe = node.args[0]
                if isinstance(probe, ast.Name) and probe.id in functions and not _loads(probe.id, functions, set()):
                    places.append(f"{module}: {_name(node)}({probe.id}, ...) loads no code under test")
    return sorted(set(places))


def test_every_reference_is_computed_where_no_submission_ran():
    """Issue 36: exercises 11, 13 and 14 ran torch's ZeroRedundancyOptimizer, fully_shard and parallelize_module
    in the kept world where the submission had been imported (found here, run on that tree); a zero.py that
    replaced ZeroRedundancyOptimizer with its own mistake scored that check's points. Every probe of a
    submission's world loads the submission; the others run in reference_world(). (A probe that runs the
    submission and then torch's reference in one call, as exercises 4 and 15 did, or by a flag, as 10 and 11
    did, loads the submission and is not found: the reviewer's to refuse.)"""
    found = probes_without_submission(check_sources())
    assert not found, f"compute references with reference_world(): {found}"


def test_the_references_in_a_submissions_world_are_found():
    """The walk finds a probe of world() that loads nothing, through helpers too, and passes one that loads the
    submission through a helper or a lambda."""
    helpers = """
def load(folder):
    pass
def module_of(folder):
    return load(folder).zero
def ddp_steps(steps):
    return steps
"""
    checks = """
def torch_steps(steps):
    return steps
def student_steps(folder):
    return module_of(folder).step()
def wrapped(folder):
    return {"mine": lambda: load(folder)}["mine"]()
def check(folder):
    world(torch_steps, 2, 3, expect=int), world(ddp_steps, 2, 3, expect=int), alone(student_steps, folder, expect=int)
    world(wrapped, 2, folder, expect=int), reference_world(torch_steps, 2, 3, expect=int)
"""
    assert probes_without_submission({"helpers": helpers, "test_ex00_x": checks}) == [
        "test_ex00_x: world(ddp_steps, ...) loads no code under test",
        "test_ex00_x: world(torch_steps, ...) loads no code under test",
    ]
