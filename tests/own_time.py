"""Seconds as a world has them, for a test's bound on how soon something happens.

A world's waits and limits run on its own time (course/runtime/processes.py's OwnTime: the wall
time less the longest that any of its processes waited for a CPU). A test that bounds, say, the
seconds from a hang to its report in wall time fails on a busy machine for a report that came as
soon as the world's own clock allowed. ``with Watch() as watch:`` samples OwnTime over this
process and its descendants (the world's workers, a script's interpreter) while the block runs;
``watch.own(seconds)`` turns wall seconds of the block into the world's own: the same on an idle
machine, at most OwnTime.SLOWEST times fewer on a loaded one.
"""

import os
import threading
import time

from course.runtime.processes import OwnTime


class Watch:
    SAMPLE = 0.2  # seconds between samples: a process is seen alive, and its waits read, at least this often

    def __enter__(self):
        self.clock, self.stop = OwnTime([os.getpid()]), threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(self.SAMPLE):
            self.clock.elapsed()

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.own_seconds = self.clock.elapsed()
        self.wall_seconds = time.monotonic() - self.clock.began

    def own(self, seconds: float) -> float:
        """Wall seconds of the block, as the world's own: scaled by the share of the block it had to run."""
        return seconds * self.own_seconds / self.wall_seconds
