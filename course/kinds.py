"""The kinds of failure, in one place: each kind's name (what a Failure, a check's mistake and the
class report store), whether it is one rank's story or every rank's, the few words that title it in
the class report, and what it means for a submission as a whole. course/runtime/failure.py words a
failure's sentence from its fields; course/grading/explain.py and course/instructors/report.py read
the kind here, never a sentence.

This module imports nothing of the course: every layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    name: str
    label: str  # the class report's title for it, before any place
    story: bool = False  # every rank's story (a hang, a mismatch), not one rank's that stopped the others
    trouble: str = ""  # what it makes of a submission as a whole ("hung"), if anything
    world: bool = False  # a kind of a world's failure (course/runtime/failure.py's Failure.kind)


_ALL = (
    # What went wrong in a world of workers (course/runtime/failure.py's Failure.kind).
    Kind("stub", "not written yet", world=True),
    Kind("error", "raised", world=True),
    Kind("crash", "crashed", trouble="crashed", world=True),
    Kind("no_result", "ended without sending its result", world=True),
    Kind("unwaited", "returned with a request never waited for", world=True),
    Kind("mismatch", "ranks called different collectives", story=True, world=True),
    Kind("arguments", "ranks called a collective with different arguments", story=True, world=True),
    Kind("wait", "ranks waited in a collective that not every rank joined", story=True, trouble="hung", world=True),
    Kind("p2p_deadlock", "deadlock: every rank waits in a send or receive", story=True, trouble="hung", world=True),
    Kind("timeout", "timed out, still running", story=True, trouble="hung", world=True),
    # What a failed check found besides (course/grading/explain.py's mistake).
    Kind("unimportable", "does not import", trouble="did not import"),
    Kind("assert", "assertion failed"),
    Kind("exception", "raised"),
    # What autograding saw of a notebook's cell, when the check could not say more (course/instructors/autograde.py).
    Kind("check_died", "the check's process died", trouble="crashed"),
    Kind("kernel_died", "the kernel that ran the checks died", trouble="crashed"),
    Kind("cell_timeout", "the cell ran past --cell-timeout", trouble="hung"),
    Kind("cell_error", "the cell raised"),
    Kind("not_graded", "nbgrader could not grade the notebook", trouble="could not be graded"),
    Kind("stderr", "the cell wrote to stderr"),
    Kind("no_points", "no points, and no reason recorded"),
)
KINDS = {kind.name: kind for kind in _ALL}
# The kinds of a world's failure, which the workers' Failure may have.
WORLD = tuple(kind.name for kind in _ALL if kind.world)
