"""What a failed check found, said two ways: one sentence for the student (explain), and facts that do
not depend on its wording (mistake), which the class report groups by. Both read the fields of what
failed (course/runtime/failure.py's Failure, an assert's frame), never another module's sentence.
"""

from __future__ import annotations

import os
import traceback

from course.exercises import STUDENT_FILES
from course.grading.points import concept_of
from course.kinds import KINDS
from course.layout import ROOT
from course.runtime.failure import first_line

# The grader's own folders: a frame there is the check's (or the course's), never the student's.
OWN_FOLDERS = ("course", "checks")
_HOOKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugin.py")  # in every check's traceback


def explain(error: BaseException) -> str:
    """One sentence saying what a failed check found, from the exception it raised."""
    failure = getattr(error, "failure", None)  # a world of workers that failed (course.runtime.workers.WorldFailed)
    if failure is not None:
        first = failure.fact(failure.first) if failure.first is not None else None
        return first.message if first is not None and first.unimportable else failure.sentence()
    if isinstance(error, (AssertionError, NotImplementedError, ImportError)) and first_line(str(error)):
        return first_line(str(error))
    return f"{type(error).__name__}: {first_line(str(error))}".rstrip(": ")


def _place(frames: list, keep) -> dict:
    """file, line and func of the innermost of traceback frames that `keep` accepts ({} if none).

    A line of a student's file is left out: it moves with every edit, and students' files differ.
    """
    frame = next((f for f in reversed(frames) if keep(f[0])), None)
    if frame is None:
        return {}
    name = os.path.basename(frame[0])
    return {"file": name, "func": frame[2]} | ({} if name in STUDENT_FILES else {"line": frame[1]})


def _judge(path: str) -> bool:
    """A file of the grader's own checks (checks/) or of the course (course/), but the plugin: its hooks
    are in every check's traceback."""
    path = os.path.abspath(path)
    return path != _HOOKS and path.startswith(tuple(os.path.join(ROOT, d) + os.sep for d in OWN_FOLDERS))


def mistake(error: BaseException) -> dict:
    """What a failed check diagnosed, as facts: the same mistake gives the same dict, whatever its sentence.

    - a world of workers that failed: course.runtime.failure.Failure's kind, and for the rank that went
      wrong first (every waiting rank, for a hang) the collective, the place (file, func) and the limit
      of its sandboxed world that it reached (disk, file, memory);
      a stub names its function, a file that does not import the file and the error;
    - the check's own assertion: the file, line and function of the `assert` that failed, in
      checks/ (one statement judges one thing);
    - any other exception: its class and where the grader's code met it.
    """
    failure = getattr(error, "failure", None)  # course.runtime.workers.WorldFailed
    if failure is not None:
        first = failure.fact(failure.first) if failure.first is not None else None
        if first is not None and first.unimportable:
            return {"kind": "unimportable"} | first.unimportable
        if failure.kind == "stub":
            return {"kind": "stub", "exercise": failure.stub["exercise"], "func": failure.stub["func"]}
        # A hang or a mismatch is the story of every rank; anything else, of the one that went wrong first.
        story = KINDS[failure.kind].story or first is None
        ranks = failure.ranks if story else [first]
        return {
            "kind": failure.kind,
            "ranks": [
                {"rank": f.rank, "state": f.state}
                | ({"error": f.error} if f.error and f.state == "raised" else {})
                | ({"collective": f.op or f.collective} if f.op or f.collective else {})
                | ({"file": f.file, "func": f.func} if f.file else {})
                | ({"line": f.line} if f.file and f.file not in STUDENT_FILES else {})
                | ({"limit": f.limit} if f.limit and failure.limits else {})  # of its sandboxed world's
                for f in ranks
            ],
        }
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(error.__traceback__)]
    place = _place(frames, _judge) or _place(frames, lambda path: True)  # a check kept outside checks/
    if isinstance(error, AssertionError):
        # The frame of the assert that failed: the innermost judge's, as _place picked it.
        live = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
        frame = next((f for f in reversed(live) if _judge(f.f_code.co_filename)), live[-1] if live else None)
        concept = concept_of(error, frame)
        return {"kind": "assert"} | place | ({"concept": concept} if concept else {})
    return {"kind": "exception", "error": type(error).__name__} | place
