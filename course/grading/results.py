"""A grade as data and in its formats: the checks and what became of them (Check), the table that
`make grade` prints, results.json in Gradescope's format, GitHub Classroom's result, and the one way
results.json is written (write_json).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

from course.exercises import EXERCISES

# The output type that carries what each case of a graded notebook cell found (its points, its
# sentence, mistake()'s facts) out of a cell that autograding runs: course/grading/in_notebook.py shows
# them, course/instructors/autograde.py reads them.
CASES_MIME = "application/vnd.ddp-course.cases+json"


@dataclass
class Check:
    """One graded check and what became of it."""

    exercise: int
    name: str
    passed: bool
    message: str = ""
    max_score: float = 0.0
    # Code not written yet, as course.runtime.failure.Failure.stub says: {"exercise", "func", "handout"}.
    stub: dict | None = None
    # What a failed check diagnosed, as facts that do not depend on its wording (mistake()); the
    # class report (course/instructors/report.py) groups the failures of a class by it.
    mistake: dict | None = None
    # How long the check ran (autograding: its notebook cell), when known.
    seconds: float | None = None

    @property
    def score(self) -> float:
        return self.max_score if self.passed else 0.0


def _fmt(points: float) -> str:
    return f"{round(points, 2):g}"


def _row(label, passed: int, total: int, score: float, top: float) -> str:
    return f"{label:>8}  {f'{passed}/{total}':>7}  {f'{_fmt(score)}/{_fmt(top)}':>11}"


def table(checks: list) -> str:
    """Per exercise: checks passed, points, and each distinct failure once with the checks it failed."""
    lines = [f"{'exercise':>8}  {'checks':>7}  {'points':>11}"]
    shown: set = set()
    for exercise in sorted({c.exercise for c in checks}):
        mine = [c for c in checks if c.exercise == exercise]
        lines.append(
            _row(
                exercise,
                sum(c.passed for c in mine),
                len(mine),
                sum(c.score for c in mine),
                sum(c.max_score for c in mine),
            )
        )
        failed = [c for c in mine if not c.passed]
        unwritten = [c.stub for c in failed if c.stub]
        if unwritten:  # an untouched exercise reads as one line, not one per check
            where = ", ".join(dict.fromkeys(f"{stub['func']} (see {stub['handout']})" for stub in unwritten))
            lines.append(
                f"          x {len(unwritten)} check{'s stop' if len(unwritten) > 1 else ' stops'} at code not written yet: {where}"
            )
        failures: dict = {}
        for check in failed:
            if not check.stub:
                failures.setdefault(check.message, []).append(check.name)
        for message, names in failures.items():
            who = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"
            # A file that does not import fails several exercises: its error is printed once.
            said = f"as above ({message.split(':')[0]})" if message in shown else message
            lines.append(f"          x {who}: {said}")
            if any(check.mistake and check.mistake.get("kind") == "unimportable" for check in failed):
                shown.add(message)
    lines.append(
        _row(
            "total",
            sum(c.passed for c in checks),
            len(checks),
            sum(c.score for c in checks),
            sum(c.max_score for c in checks),
        )
    )
    return "\n".join(lines)


def gradescope(checks: list, seconds: float, note: str = "", advisory: str = "") -> dict:
    """The results in Gradescope's autograder format (results.json); ``note`` ends its output.
    ``advisory``: why the grade cannot be trusted for credit (course/runtime/sandbox.py's Level.advisory),
    kept in its extra_data."""
    return {
        "score": round(sum(c.score for c in checks), 4),
        "execution_time": round(seconds),
        "output": table(checks) + (f"\n{note}" if note else ""),
        "tests": [
            {
                "name": f"Exercise {c.exercise}: {c.name}",
                "score": round(c.score, 4),
                "max_score": round(c.max_score, 4),
                "status": "passed" if c.passed else "failed",
                "output": c.message,
                "visibility": "visible",
            }
            | (
                {"extra_data": {"mistake": c.mistake}} if c.mistake else {}
            )  # what course/instructors/report.py groups by
            for c in checks
        ],
    } | ({"extra_data": {"advisory": advisory}} if advisory else {})


def write_results(path: str, checks: list, seconds: float, note: str = "", advisory: str = "") -> None:
    """Write results.json in one step and read it back (write_json)."""
    write_json(path, gradescope(checks, seconds, note, advisory))


# What results.json says from before the first check until the last: a grader that was stopped
# (killed, out of time) leaves it, and a score of 0 that says why.
UNFINISHED = {
    "score": 0,
    "output": "The grader did not finish: it was stopped before it could write the grade.",
    "tests": [],
}


def classroom(results: dict) -> dict:
    """results.json's grade as a GitHub Classroom grader's result: what its grading reporter reads
    (base64 of this JSON, an output `result` of the step that graded): the same score and checks."""
    tests = [
        {
            "name": test["name"],
            "status": {"passed": "pass", "failed": "fail"}[test["status"]],
            "score": test["score"],
            "message": test["output"],
        }
        for test in results["tests"]
    ]
    graded = all(test["max_score"] > 0 for test in results["tests"]) and tests
    return {
        "version": 1,
        "status": ("pass" if all(t["status"] == "pass" for t in tests) else "fail") if graded else "error",
        "max_score": sum(test["max_score"] for test in results["tests"]),
        "tests": tests
        if graded
        else [{"name": "The grader", "status": "error", "score": 0, "message": results["output"]}],
    }


def give_github_output(results: dict) -> None:
    """Append ``result=`` (base64 of ``classroom(results)``) to the file named by $GITHUB_OUTPUT."""
    import base64

    encoded = base64.b64encode(json.dumps(classroom(results)).encode()).decode()
    with open(os.environ["GITHUB_OUTPUT"], "a") as f:
        f.write(f"result={encoded}\n")


def no_such_exercise(chosen: list | None) -> str:
    """The sentence that refuses the numbers of chosen that are not exercises ("" when all are)."""
    exercises = [e.number for e in EXERCISES]
    unknown = [n for n in chosen or [] if n not in exercises]
    if not unknown:
        return ""
    return f"no exercise {', '.join(map(str, unknown))}; exercises are {min(exercises)}–{max(exercises)}"


# What a grade that Ctrl-C stopped says at its end; its results.json is interrupted().
INTERRUPTED = "Interrupted: no grade (results.json says so)."


def interrupted() -> dict:
    """results.json of a grade that Ctrl-C stopped: the checks that ran are no grade."""
    return not_graded(["grading was interrupted (Ctrl-C) before it gave a grade"])


def not_graded(problems: list) -> dict:
    """results.json of a run that could not grade: it says so, and gives no score as if earned."""
    said = "\n".join(f"GRADER ERROR (not your code): {p}" for p in problems)
    return {
        "score": 0,
        "output": f"This submission could not be graded, so 0 is not its score: ask your instructor.\n{said}",
        "tests": [{"name": "The grader", "status": "failed", "score": 0, "max_score": 0, "output": said}],
    }


def write_json(path: str, data: dict) -> None:
    """Write a JSON file in one step: a new file of a name no one can know beforehand (O_EXCL,
    never a file or link planted there), then os.replace. Read back.

    Raises RuntimeError when the file read back is not the one written: another process wrote it.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    with open(path) as f:
        if json.load(f) != data:
            raise RuntimeError(f"{path} changed after the grader wrote it: another process wrote it")
