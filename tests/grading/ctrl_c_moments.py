"""A pytest plugin for the tests: a grade held at one moment of it, for the test's Ctrl-C to land there
(issue 49).

    COURSE_CTRL_C_AT=MOMENT COURSE_CTRL_C_NOTES=FILE python -m course grade -- -p tests.grading.ctrl_c_moments

When the grade reaches MOMENT, the process there appends "MOMENT" to FILE and waits until the test
has sent its Ctrl-C (it appends "sent") or a KeyboardInterrupt ends the wait; then it goes on. A
sandboxed worker, which can read no file of the test's, takes a process name instead, and waits
until it is stopped. The moments, in a grade's order:

- configuring: pytest configures the grade (results.json says it did not finish); its session has
  not begun.
- collecting: the grading process is about to import a module of checks; no world has started.
- world-starts: the grading process has just forked a worker of its first world, and runs Python's
  handlers of a fork (where a KeyboardInterrupt is printed and dropped); the worker has run nothing.
- check-runs: the workers of the grading process's first check run its call (they load the code
  under test), in the process name ctrl-c-check.
- copy-checks: the grading process has run its share of the checks and waits for its copy's reports
  (course/grading/share.py); the copy is in a check, its last one, until Ctrl-C.
- results: the grade is in results.json, and not printed yet.
"""

import ctypes
import multiprocessing.process
import os
import time

import pytest

from course import impl
from course.grading import plugin as grading
from course.grading import share

MOMENT = os.environ["COURSE_CTRL_C_AT"]
NOTES = os.environ["COURSE_CTRL_C_NOTES"]
_grader = os.getpid()  # imported as pytest starts: the copy, forked later, has another pid


def _note(moment: str) -> None:
    with open(NOTES, "a") as f:
        f.write(f"{moment}\n")


def _until_ctrl_c() -> None:
    """Until the test has sent its Ctrl-C, or a KeyboardInterrupt ends the wait."""
    while True:
        with open(NOTES) as f:
            if "sent\n" in f.read():
                return
        time.sleep(0.01)


def _held(moment: str) -> None:
    """At moment, in the process that is there: note it, and wait for the test's Ctrl-C."""
    if moment == MOMENT:
        _note(moment)
        _until_ctrl_c()


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    _held("configuring")


def pytest_collectstart(collector):
    if isinstance(collector, pytest.Module) and os.getpid() == _grader:
        _held("collecting")


_forking_a_worker = False


def _worker_forked() -> None:
    if _forking_a_worker and os.getpid() == _grader:  # a later fork finds the Ctrl-C sent, and goes on
        _held("world-starts")


def _starting(start):
    def started(process):
        global _forking_a_worker
        _forking_a_worker = True
        try:
            return start(process)
        finally:
            _forking_a_worker = False

    return started


def _blocked(load):
    def loading(folder):
        ctypes.CDLL(None).prctl(15, b"ctrl-c-check", 0, 0, 0)  # PR_SET_NAME: what the test sees
        time.sleep(600)  # a worker ignores Ctrl-C: it waits for its world to be stopped
        return load(folder)

    return loading


_blocking = False


def pytest_runtest_setup(item):
    # Here, not at import: the copy, forked before the first check, keeps the code under test as it is.
    global _blocking
    if MOMENT == "check-runs" and os.getpid() == _grader and not _blocking:
        impl.load, _blocking = _blocked(impl.load), True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    processes = item.config.getoption("grade_processes")
    if MOMENT == "copy-checks" and os.getpid() != _grader and item is item.session.items[1::processes][-1]:
        _until_ctrl_c()
    return (yield)


def _waiting_for_reports(reports):
    def waiting(self):
        _note("copy-checks")  # the copy holds in its last check until the test's Ctrl-C
        return reports(self)

    return waiting


def _writing(write_json):
    def writing(path, data):
        write_json(path, data)
        if data is not grading.UNFINISHED:
            _held("results")

    return writing


if MOMENT == "world-starts":
    os.register_at_fork(after_in_parent=_worker_forked)
    multiprocessing.process.BaseProcess.start = _starting(multiprocessing.process.BaseProcess.start)
if MOMENT == "copy-checks":
    share.Share.reports = _waiting_for_reports(share.Share.reports)
grading.write_json = _writing(grading.write_json)
