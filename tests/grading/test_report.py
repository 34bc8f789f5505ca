"""Instructors only: the class report (course/instructors/report.py), built from check records made here.

The end-to-end run of tests/grading/test_autograde.py checks the report of real submissions; these checks
build it from synthetic records (no nbgrader, no worlds), and open the page in a headless browser
where one is installed (chromium; skipped elsewhere).
"""

import ast
import glob
import json
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from course.grading.explain import mistake
from course.grading.points import said
from course.grading.results import Check
from course.instructors import report
from course.layout import ROOT
from course.runtime.failure import Failure, RankFact, diagnose
from course.runtime.workers import WorldFailed

MESSAGE = "rank 1's gradient of layers.0.weight is 2.0x the expected average: did you divide by the world size?"


def asserting(value):
    assert value == 1, f"the value is {value}, not 1"


def raised(fn, *args) -> BaseException:
    with pytest.raises(Exception) as caught:
        fn(*args)
    return caught.value


def test_the_same_assertion_is_the_same_mistake_whatever_its_words():
    two, three = mistake(raised(asserting, 2)), mistake(raised(asserting, 3))
    assert two == three, "the facts of a failed assert must not depend on its message"
    assert two == {
        "kind": "assert",
        "file": "test_report.py",
        "func": "asserting",
        "line": asserting.__code__.co_firstlineno + 1,
    }
    assert mistake(raised(lambda: 1 / 0))["kind"] == "exception"


def test_a_world_failure_is_its_kind_and_the_ranks_facts():
    crash = Failure(
        "crash",
        2,
        [RankFact(0, "crashed", file="mlp.py", line=12, func="__init__", exit_code=-11), RankFact(1, "echo")],
        first=0,
    )
    assert mistake(WorldFailed(crash)) == {
        "kind": "crash",
        "ranks": [{"rank": 0, "state": "crashed", "file": "mlp.py", "func": "__init__"}],
    }, "a crash is the first rank's; a line of the student's file is left out (it moves with every edit)"
    hang = Failure(
        "wait",
        2,
        [
            RankFact(0, "waited", collective="all_reduce", file="mydp.py", func="hook"),
            RankFact(1, "waited", collective="broadcast", file="mydp.py", func="__init__"),
        ],
        first=0,
    )
    assert [r["collective"] for r in mistake(WorldFailed(hang))["ranks"]] == ["all_reduce", "broadcast"]
    stub = Failure("stub", 2, [RankFact(0, "raised", "NotImplementedError", "Exercise 4: x")], first=0)
    stub.stub = {"exercise": 4, "func": "MyDP.__init__", "handout": "exercises/04_mydp.md"}
    assert mistake(WorldFailed(stub)) == {"kind": "stub", "exercise": 4, "func": "MyDP.__init__"}
    broken = Failure(
        "error",
        2,
        [
            RankFact(
                0,
                "raised",
                "ImportError",
                "mlp.py does not import: SyntaxError: invalid",
                unimportable={"file": "mlp.py", "error": "SyntaxError"},
            )
        ],
        first=0,
    )
    assert mistake(WorldFailed(broken)) == {"kind": "unimportable", "file": "mlp.py", "error": "SyntaxError"}


SUMS = {"kind": "assert", "file": "helpers.py", "func": "check_equivalence", "line": 158}
CRASH = {"kind": "crash", "ranks": [{"rank": 0, "state": "crashed", "file": "mlp.py", "func": "__init__"}]}
HANG = {
    "kind": "wait",
    "ranks": [
        {"rank": 0, "state": "waited", "collective": "scatter", "file": "dist.py", "func": "f"},
        {"rank": 1, "state": "waited", "collective": "recv", "file": "dist.py", "func": "f"},
    ],
}
# The same hang in a world of 3: one more rank waits where rank 1 does.
HANG_3 = HANG | {"ranks": HANG["ranks"] + [HANG["ranks"][1] | {"rank": 2}]}
CRASH_1 = {"kind": "crash", "ranks": [{"rank": 1, "state": "crashed", "file": "mlp.py", "func": "__init__"}]}
BROKEN = {"kind": "unimportable", "file": "mlp.py", "error": "SyntaxError"}


def checks(ex1=None, ex4=None, ex1_message="", ex4_message="", seconds=1.0) -> list:
    """Two exercises of two checks each; ex1/ex4: the mistake of the second check, None if it passed."""
    made = [
        Check(1, "ex1_layers", True, "", 10, seconds=seconds),
        Check(1, "ex1_train", ex1 is None, ex1_message, 10, mistake=ex1, seconds=seconds),
        Check(4, "ex4_start", True, "", 10, seconds=seconds),
        Check(4, "ex4_steps", ex4 is None, ex4_message, 20, mistake=ex4, seconds=2 * seconds),
    ]
    if ex1 == BROKEN:  # a file that does not import fails every check that uses it
        made[0] = Check(1, "ex1_layers", False, ex1_message, 10, mistake=BROKEN, seconds=seconds)
    return made


def class_results() -> dict:
    return {
        "ada": checks(),
        "ben": checks(ex4=SUMS, ex4_message=MESSAGE),
        "cai": checks(ex4=SUMS, ex4_message=MESSAGE.replace("2.0x", "3.0x").replace("rank 1", "rank 2")),
        "dee": checks(ex4=SUMS, ex4_message=MESSAGE, seconds=5.0),
        "eve": checks(ex1=CRASH, ex1_message="Rank 0 of 2 crashed with exit code -11 (signal 11) at mlp.py:12"),
        "fay": checks(ex1=HANG, ex1_message="Ranks [0, 1] waited in a collective that not every rank joined: ..."),
        "gus": checks(ex1=BROKEN, ex1_message="mlp.py does not import: SyntaxError: expected ':'"),
        "hal": checks(ex1=HANG_3, ex1_message="Ranks [0, 1, 2] waited in a collective that not every rank joined"),
        "ivy": checks(ex1=CRASH_1, ex1_message="Rank 1 of 2 crashed with exit code -11 (signal 11) at mlp.py:14"),
    }


class References(HTMLParser):
    """Every attribute of the page that could load something: src, href, xlink:href, url(...)."""

    def __init__(self):
        super().__init__()
        self.found, self.svgs, self.tags = [], 0, set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.svgs += tag == "svg"
        for name, value in attrs:
            if name in ("src", "href", "xlink:href", "srcset", "action", "data", "poster") and value:
                self.found.append(f"<{tag} {name}={value}>")
            if name == "style" and value and "url(" in value:
                self.found.append(f"<{tag} style={value}>")

    def handle_data(self, data):
        if "url(" in data or "@import" in data:
            self.found.append(data.strip()[:80])


def test_the_report_groups_one_mistake_into_one_row_and_lists_the_troubled(tmp_path):
    summary = report.write(str(tmp_path), class_results())
    by_title = {m["title"]: m for m in summary["mistakes"]}
    first = summary["mistakes"][0]
    assert first["mistake"] == {"exercise": 4} | SUMS and first["count"] == 3, summary["mistakes"]
    assert first["students"] == ["ben", "cai", "dee"] and first["wordings"] == 2, "two wordings, one mistake"
    assert first["title"] == "assertion failed in check_equivalence (helpers.py:158)"
    crashed = by_title["a rank crashed at mlp.py, __init__"]
    assert crashed["students"] == ["eve", "ivy"], "the same crash, whichever rank crashed first"
    hung = by_title[
        "ranks waited in a collective that not every rank joined: in recv at dist.py, f; in scatter at dist.py, f"
    ]
    assert hung["students"] == ["fay", "hal"], "the same hang, whatever the world's size"
    broken = by_title["mlp.py does not import (SyntaxError)"]
    assert broken["count"] == 1 and broken["checks"] == ["ex1_layers", "ex1_train"], "one row per student"
    assert len(summary["mistakes"]) == 4
    assert [(t["student"], t["what"]) for t in summary["troubled"]] == [
        ("eve", "crashed"),
        ("fay", "hung"),
        ("gus", "did not import"),
        ("hal", "hung"),
        ("ivy", "crashed"),
    ]
    assert summary["troubled"][0]["reason"].startswith("Rank 0 of 2 crashed")

    ex4 = next(e for e in summary["exercises"] if e["exercise"] == 4)
    assert ex4["max_score"] == 30 and ex4["scores"]["ben"] == 10 and ex4["scores"]["ada"] == 30
    assert [b["students"] for b in ex4["histogram"]] == [0, 0, 0, 3, 0, 0, 0, 0, 0, 6], "3 at 10/30, 6 at 30/30"
    assert {c["name"]: c["share"] for c in ex4["checks"]} == {"ex4_start": 1.0, "ex4_steps": round(6 / 9, 3)}
    assert summary["timing"]["by_student"][0]["student"] == "dee", "the slowest submission comes first"
    assert summary["timing"]["by_student"][0]["median_s"] == 5.0

    with open(tmp_path / "report.json") as f:
        saved = json.load(f)
    assert {k: v for k, v in saved.items() if k != "checks"} == json.loads(json.dumps(summary))
    assert len(saved["checks"]) == 9 * 4 and saved["checks"][0]["student"] == "ada"

    page = (tmp_path / "report.html").read_text()
    parsed = References()
    parsed.feed(page)
    assert parsed.found == [], f"the page refers to something outside it: {parsed.found}"
    assert parsed.svgs == 2 * 2 and "script" not in parsed.tags, "two charts per exercise, no script"
    for text in ("helpers.py:158", "ben, cai, dee", "did not import", "Rank 0 of 2 crashed", "(2 different messages)"):
        assert text in page, text

    done = subprocess.run(
        [sys.executable, "-m", "course.instructors.report", str(tmp_path), "--top", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].split() == [
        "3",
        "exercise",
        "4:",
        "assertion",
        "failed",
        "in",
        "check_equivalence",
        "(helpers.py:158)",
    ]
    assert len([line for line in lines if line.strip().startswith("e.g.")]) == 2, done.stdout
    assert report.main([str(tmp_path / "not_graded_yet")]) == 1, "no report.json: say so, exit 1"


def test_the_report_escapes_what_submissions_wrote(tmp_path):
    results = {"<b>x</b>": checks(ex4=SUMS, ex4_message="<script>alert(1)</script>")}
    report.write(str(tmp_path), results)
    page = (tmp_path / "report.html").read_text()
    assert "<script>" not in page and "<b>x</b>" not in page and "&lt;script&gt;" in page


BROWSER = next(
    (shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)), None
)


def headless(page: str, *flags) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0", *flags, page],
        capture_output=True,
        text=True,
        timeout=120,
    )


def console(done: subprocess.CompletedProcess) -> list:
    """What the page wrote to the browser's console: errors, and refused loads (the page's policy)."""
    return [line for line in done.stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.skipif(BROWSER is None, reason="no chromium on PATH (apt-get install chromium)")
def test_the_page_renders_in_a_headless_browser(tmp_path):
    from PIL import Image

    report.write(str(tmp_path), class_results())
    page = f"file://{tmp_path / 'report.html'}"
    shot = tmp_path / "report.png"
    done = headless(page, f"--screenshot={shot}", "--window-size=1100,1900", "--hide-scrollbars")
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    assert console(done) == [], f"the browser's console: {console(done)}"
    colors = Image.open(shot).convert("RGB").getcolors(1 << 20)
    pixels = {color: n for n, color in colors}
    for name, color in (("histogram bars", report._BAR), ("passing checks' bars", report._PASS)):
        rgb = tuple(int(color[i : i + 2], 16) for i in (1, 3, 5))
        assert pixels.get(rgb, 0) > 500, f"the {name} ({color}) are not drawn: {pixels.get(rgb, 0)} pixels"

    dom = headless(page, "--dump-dom")
    assert dom.stdout.count("<svg") == 4 and "<rect" in dom.stdout and "Most frequent mistakes" in dom.stdout

    # The same browser does report a reference outside the page: the check above can fail.
    (tmp_path / "leaky.html").write_text(
        (tmp_path / "report.html").read_text().replace("<h1>", '<img src="chart.png"><h1>')
    )
    assert console(headless(f"file://{tmp_path / 'leaky.html'}", "--dump-dom")), "a refused load must show"


def test_what_autograding_saw_of_a_cell_is_a_mistake_too():
    """A cell that showed its cases gives each case's facts; one that could not still has a kind: a
    time limit, a dead kernel."""
    from course.grading.results import CASES_MIME
    from course.instructors.autograde import _cases, _mistake, _seconds

    def cell(*outputs, **execution):
        return {"outputs": list(outputs), "metadata": {"execution": execution}}

    def error(name):
        return {"output_type": "error", "ename": name, "evalue": "", "traceback": []}

    case = {"name": "test_mydp_steps[2]", "points": 5, "passed": False, "message": "x", "mistake": SUMS, "seconds": 1.0}
    shown = {"output_type": "display_data", "data": {CASES_MIME: {"cases": [case]}}, "metadata": {}}
    assert _cases(cell(shown)) == {"test_mydp_steps[2]": case} and _cases(cell(error("CheckFailed"))) is None
    assert _mistake(cell(error("KeyboardInterrupt"))) == {"kind": "cell_timeout"}
    assert _mistake(cell(error("NotGraded"))) == {"kind": "kernel_died"}
    assert _mistake(cell({"output_type": "stream", "name": "stderr", "text": "x"})) == {"kind": "stderr"}
    assert report.TROUBLE["cell_timeout"] == "hung" and report.TROUBLE["kernel_died"] == "crashed"
    timed = cell(
        **{"iopub.execute_input": "2026-01-05T10:00:00.250000Z", "shell.execute_reply": "2026-01-05T10:00:02Z"}
    )
    assert _seconds(timed) == 1.75 and _seconds(cell()) is None


def described(value):
    """The value is one. (The first sentence of a check's docstring: the concept of its asserts.)"""
    assert value == 1, f"the value is {value}"


def diagnosed(value):
    # Raised, not asserted: pytest rewrites this module's asserts, and their message with them.
    if value != 1:
        raise AssertionError(said("a value of two", "the value is 2") if value == 2 else f"the value is {value}")


def test_a_row_is_titled_by_what_the_check_diagnosed():
    """Issue 28: rows were titled 'assertion failed in check_equivalence (helpers.py:188)', and two
    diagnoses of one assert shared a row. A check's said() concept, else its docstring, titles it."""
    assert mistake(raised(described, 2))["concept"] == "The value is one"
    two, three = mistake(raised(diagnosed, 2)), mistake(raised(diagnosed, 3))
    assert two["concept"] == "a value of two" and "concept" not in three and two != three
    assert report.title(two) == "a value of two"


def test_a_limit_reached_is_its_own_row():
    """Issue 47: a rank that reached a limit of its sandboxed world (its folder full, say) is a mistake of its
    own in the class report, titled with the limit, not one with the same error on the machine's own disk."""
    said = "[Errno 28] No space left on device"
    report_ = dict(rank=0, when=1.0, error="OSError", message=said, full_message=said, frames=[("/s/dist.py", 3, "f")])
    limited = mistake(WorldFailed(diagnose([report_], [], 2, {"disk": 256, "file": 16, "memory": 4096})))
    unlimited = mistake(WorldFailed(diagnose([report_], [], 2)))
    assert limited != unlimited and report.title(limited).endswith("past the world's disk limit"), limited
    assert "limit" not in report.title(unlimited)


def _own_nodes(function):
    """The nodes of a function's body, without those of the functions and classes defined in it."""
    stack = list(function.body)
    while stack:
        node = stack.pop()
        yield node
        stack += [
            c for c in ast.iter_child_nodes(node) if not isinstance(c, (ast.FunctionDef, ast.Lambda, ast.ClassDef))
        ]


def _holds_assert(function) -> bool:
    return any(True for _ in _failures(function))


def _says(function) -> bool:
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "said"
        for node in _own_nodes(function)
    )


def untitled(sources: dict) -> list:
    """The functions holding an assert that a check (a test_* function) reaches by calls, whose failure would
    title its row 'assertion failed in FUNC (file:line)': {module: source}, the module 'helpers' among them.

    A module-level function is titled by a said() concept or its docstring's first sentence (course/grading/points.py's
    concept_of); one defined inside another only by said(): concept_of finds functions by their module's names.
    """
    trees = {module: ast.parse(source) for module, source in sources.items()}
    defined = {
        (m, node.name): node for m, tree in trees.items() for node in tree.body if isinstance(node, ast.FunctionDef)
    }
    imported = {
        (m, alias.asname or alias.name): ("helpers", alias.name)
        for m, tree in trees.items()
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module == "checks.helpers"
        for alias in node.names
    }
    todo = [key for key in defined if key[1].startswith("test_")]
    reached = set(todo)
    while todo:
        module, _ = key = todo.pop()
        for node in ast.walk(defined[key]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                callee = (
                    (module, node.func.id)
                    if (module, node.func.id) in defined
                    else imported.get((module, node.func.id))
                )
                if callee in defined and callee not in reached:
                    reached.add(callee)
                    todo.append(callee)
    found = []
    for module, name in sorted(reached):
        top = defined[module, name]
        for function in (f for f in ast.walk(top) if isinstance(f, ast.FunctionDef) and _holds_assert(f)):
            if not (_says(function) or (function is top and ast.get_docstring(function))):
                found.append(f"{module}.{function.name}")
    return found


def check_sources() -> dict:
    """{module: source} of the check modules, checks/test_exNN_*.py, and checks/helpers.py."""
    folder = os.path.join(ROOT, "checks")
    sources = {}
    for path in glob.glob(os.path.join(folder, "test_ex*.py")) + [os.path.join(folder, "helpers.py")]:
        with open(path) as f:
            sources[os.path.basename(path)[: -len(".py")]] = f.read()
    assert len(sources) > 15, sorted(sources)
    return sources


def test_every_assert_a_check_reaches_names_what_it_diagnoses():
    """Issue 29: 37 of the 91 functions holding the checks' asserts had neither a docstring nor said(), and their
    rows of the class report read 'assertion failed in check_ring (test_ex05_ring.py:58)'. Each names its promise
    (a docstring) or the mistake of each assert (said), so that no row is titled by a place."""
    missing = untitled(check_sources())
    assert not missing, f"give these a docstring naming the promise they judge, or a said() per mistake: {missing}"


def test_the_untitled_are_found():
    """The walk above finds what it looks for: a reached function without a title, directly or through
    helpers, a nested one with only a docstring; and it passes the titled and those no check reaches."""
    helpers = """
def judged(x):
    assert x
def titled(x):
    \"\"\"x is true.\"\"\"
    assert x
"""
    checks = """
from checks.helpers import judged, titled
def bare(x):
    if not x:
        raise AssertionError("x is false")
def said_so(x):
    assert x, said("x false", "x is false")
def nested(x):
    \"\"\"x is true.\"\"\"
    def inner():
        \"\"\"x is true.\"\"\"
        assert x
    inner()
def unreached(x):
    assert x
def test_x():
    bare(1); said_so(1); nested(1); judged(1); titled(1)
"""
    assert untitled({"helpers": helpers, "test_ex00_x": checks}) == [
        "helpers.judged",
        "test_ex00_x.bare",
        "test_ex00_x.inner",
    ]


def _failures(function):
    """The messages of a function's own failing statements: assert's, and raise AssertionError(...)'s (None if none)."""
    for node in _own_nodes(function):
        if isinstance(node, ast.Assert):
            yield node.msg
        elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
            if node.exc.func.id == "AssertionError":  # raise AssertionError(message)
                yield node.exc.args[0] if node.exc.args else None


def twice_plain(sources: dict) -> list:
    """The functions with two or more failing statements whose messages carry no concept: {module: source}.

    A message carries one when it is a call of said(), or of a function that returns one (describe_ratio, say),
    or a choice (x if c else y) of two such; said(...) + "..." carries none (a str added to a Said is a plain
    str). Such a function's plain messages all take the title of its docstring, and two diagnoses share it.
    """
    trees = [ast.parse(source) for source in sources.values()]
    functions = [f for tree in trees for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)]
    sayers = {"said"}

    def says(node) -> bool:
        if isinstance(node, ast.IfExp):
            return says(node.body) and says(node.orelse)
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in sayers

    grown = True
    while grown:  # the functions that return a concept, and those that return theirs
        found = {f.name for f in functions if any(isinstance(n, ast.Return) and says(n.value) for n in ast.walk(f))}
        grown = not found <= sayers
        sayers |= found
    module_of = {id(f): module for (module, tree) in zip(sources, trees) for f in ast.walk(tree)}
    return sorted(f"{module_of[id(f)]}.{f.name}" for f in functions if sum(not says(m) for m in _failures(f)) > 1)


def test_two_diagnoses_of_one_check_do_not_share_a_title():
    """Rows of the class report were titled by a check's docstring for every assert of it without said(), so
    that a check's different mistakes (ex11's check_hook: nine of them) shared one title. Each function now has
    at most one assert without a concept, the one that judges its docstring's promise."""
    shared = twice_plain(check_sources())
    assert not shared, f"give each assert that diagnoses another mistake its said(concept, sentence): {shared}"

    made = """
def described(x):
    return said("x false", "x is false")
def checked(x):
    assert x, said("x false", "x is false")
    assert x, described(x)
    assert x, said("a", "a") if x else described(x)
    assert x, "the one plain message"
def joined(x):
    assert x, "plain"
    assert x, said("x false", "x is ") + "false"
def bare(x):
    assert x
    if not x:
        raise AssertionError("x is false")
"""
    assert twice_plain({"test_ex00_x": made}) == ["test_ex00_x.bare", "test_ex00_x.joined"]


def test_code_not_written_yet_is_not_attempted_not_a_mistake():
    """Issue 28: the stubs filled the top rows of the mistakes. They are listed apart."""
    stub = {"kind": "stub", "exercise": 2, "func": "par_matmul_by_row"}
    said_ = "Exercise 2: par_matmul_by_row is not written yet, see exercises/02_dist.md"
    results = {s: [Check(2, "test_by_row[2]", False, said_, 3, mistake=stub)] for s in ("ada", "ben")}
    results["cai"] = [Check(2, "test_by_row[2]", False, MESSAGE, 3, mistake=SUMS)]
    summary = report.summarize(report.records(results))
    assert [m["students"] for m in summary["mistakes"]] == [["cai"]]
    assert summary["not_attempted"] == [
        {"function": "par_matmul_by_row", "exercise": 2, "count": 2, "students": ["ada", "ben"]}
    ]
    assert "Not attempted yet" in report.page(summary)
