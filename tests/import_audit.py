"""A pytest plugin for the tests: the modules a grading process imports once submission code may run.

    COURSE_IMPORT_AUDIT=FILE python -m course grade -- -p tests.import_audit

A module that the grader (or its copy, course/grading/plugin.py) first imports after its first world of
workers started is read from disk after submission code ran, where a worker without a sandbox
could have written its bytecode (course/runtime/sandbox.py stops that; this checks that nothing relies on
it). After each check, the process that ran it appends to FILE one line per such module: its pid
and the module's name. An empty FILE: every module was imported before.
"""

import os
import sys

from course.runtime import workers

_before: set | None = None  # the modules of this process when its first world had started


def _start_and_note(original):
    def start(*args, **kwargs):
        global _before
        world = original(*args, **kwargs)
        if _before is None:  # its workers are forked, and no code under test has run yet
            _before = set(sys.modules)
        return world

    return start


def pytest_configure(config):
    workers._World.start = classmethod(_start_and_note(workers._World.start.__func__))


def pytest_runtest_teardown(item):
    if _before is None:
        return
    late = sorted(set(sys.modules) - _before)
    if late:
        with open(os.environ["COURSE_IMPORT_AUDIT"], "a") as f:
            f.writelines(f"{os.getpid()} {name}\n" for name in late)


def _audit_autograde(argv) -> int:
    """`python -m tests.import_audit course.instructors.autograde ARGS`: autograding, with the modules its own
    process imports once its first kernel is asked for (its workers may run from then on) written
    to COURSE_IMPORT_AUDIT."""
    from course.instructors import autograde

    before = {}
    first_execute = autograde.execute

    async def execute(*args, **kwargs):
        before.setdefault("modules", set(sys.modules))
        return await first_execute(*args, **kwargs)

    autograde.execute = execute
    code = autograde.main(argv)
    late = sorted(set(sys.modules) - before.get("modules", set(sys.modules)))
    with open(os.environ["COURSE_IMPORT_AUDIT"], "a") as f:
        f.writelines(f"{os.getpid()} {name}\n" for name in late)
    return code


if __name__ == "__main__" and sys.argv[1:2] == ["course.instructors.autograde"]:
    code = _audit_autograde(sys.argv[2:])
    sys.stdout.flush()
    os._exit(code)  # as course.instructors.autograde does: no slow teardown of what nbgrader built
