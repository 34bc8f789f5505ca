"""The grader's second process: a forked copy of the grading process that runs every other check
(`--grade-processes`), and reports back as data."""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
import traceback


def processes_here() -> int:
    """Two grading processes where workers are forked (Linux, one thread per worker: 2 or 3 cores):
    one world of 2 to 4 ranks leaves a third of 2 cores idle, waiting on messages, and two worlds
    at once fill them. One elsewhere: macOS's and Windows' graders cannot fork a copy of themselves
    safely, and with more cores each worker of a world runs several threads."""
    from course.runtime import env

    cores = env.usable_cores()
    return min(2, cores) if env.checks_start_method(sys.platform, cores) == "fork" else 1


def run_items(session, items: list, log: bool) -> list:
    """Run items as pytest's own loop does; with log=False, return their reports instead of logging them."""
    from _pytest.runner import runtestprotocol

    reports = []
    for i, item in enumerate(items):
        following = items[i + 1] if i + 1 < len(items) else None
        if log:
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=following)
        else:
            reports += runtestprotocol(item, log=False, nextitem=following)
        if session.shouldstop:
            raise session.Interrupted(session.shouldstop)
    return reports


class Share:
    """A forked copy of the grading process that runs some of the checks.

    It reports to the process it was forked from through a pipe that no worker keeps
    (course/runtime/processes.py cuts a worker off every descriptor it inherited), as JSON: nothing read from
    it can run code here. It dies with that process, and leaves Ctrl-C to it. Reports missing when
    it ends (it crashed, or ran past its time) fail their checks as grader errors.
    """

    def __init__(self, session, items: list, fingerprint):
        from course.runtime import sandbox, workers

        self.config, self.items, self.changed = session.config, items, []
        reader, writer = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                os.close(reader)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                sandbox.die_with_parent()
                sandbox.protect()
                reports = [
                    self.config.hook.pytest_report_to_serializable(config=self.config, report=r)
                    for r in run_items(session, items, log=False)
                ]
                with os.fdopen(writer, "w") as pipe:
                    json.dump({"reports": reports, "changed": fingerprint.changes()}, pipe)
                code = 0
            except BaseException:  # noqa: BLE001 - said here; the parent fails the checks it did not report
                traceback.print_exc()
            finally:
                workers.stop_kept()
                os._exit(code)
        os.close(writer)
        self.pipe = reader

    def _read(self) -> bytes:
        """What it sent, read until it closes the pipe or its checks' time is up: each check's
        worlds stop at their time limit, so a copy still running after all of them is stuck."""
        limit = time.monotonic() + 60 + len(self.items) * float(os.environ.get("COURSE_TIMEOUT", 600))
        sent = b""
        while time.monotonic() < limit:
            if select.select([self.pipe], [], [], 1.0)[0]:
                chunk = os.read(self.pipe, 1 << 16)
                if not chunk:
                    return sent
                sent += chunk
        raise TimeoutError(f"it was still running after {limit:.0f} s")

    def reports(self) -> list:
        """The reports it sent, once it has ended; a failed one for each check it did not report."""
        from _pytest.reports import TestReport

        from course.runtime import processes

        try:
            found = json.loads(self._read())
            sent, self.changed = found["reports"], found["changed"]
        except (ValueError, KeyError, TypeError, TimeoutError) as error:
            sent, status = [], f"{type(error).__name__}: {error}"
            processes.stop_tree(self.pid)
        else:
            status = f"exit status {os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])}"
        self.pid = None
        reports = [self.config.hook.pytest_report_from_serializable(config=self.config, data=d) for d in sent]
        done = {r.nodeid for r in reports}
        for item in self.items:
            if item.nodeid not in done:
                reason = f"the grading process that ran it ended without its report ({status})"
                reports.append(TestReport(item.nodeid, item.location, {}, "failed", reason, "setup"))
        return reports

    def stop(self) -> None:
        if self.pid:  # it has not ended: this process was interrupted
            from course.runtime import processes

            processes.stop_tree(self.pid)
        os.close(self.pipe)
