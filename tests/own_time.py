"""Seconds as a world has them, for a test's bound on how soon something happens.

A world's waits and limits run on its own time (course/runtime/processes.py's OwnTime: the wall
time less the longest that any of its processes waited for a CPU). A test that bounds, say, the
seconds from a hang to its report in wall time fails on a busy machine for a report that came as
soon as the world's own clock allowed. ``with Watch() as watch:`` samples OwnTime over this
process and its descendants (the world's workers, a script's interpreter), and over the processes it
is told to follow (a command tests/warm.py forks elsewhere), while the block runs;
``watch.own_between(start, end)`` turns two moments of the block into the world's own seconds between
them, as the samples around each saw it (not an average over the block: a world starved after a hang
and not before it has its own time of then): the wall seconds on an idle machine, at most
OwnTime.SLOWEST times fewer on a loaded one.
"""

import os
import threading
import time

from course.runtime.processes import OwnTime


class Watch:
    SAMPLE = 0.2  # seconds between samples: a process is seen alive, and its waits read, at least this often

    def __enter__(self):
        self.clock, self.stop = OwnTime([os.getpid()]), threading.Event()
        self.epoch = time.time() - time.monotonic()  # what time.time() reads at monotonic 0
        self.samples = [(self.clock.began, 0.0)]  # (monotonic, own seconds): own time runs unevenly on a busy machine
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def follow(self, pid: int) -> None:
        """Count the process pid and its descendants too: a command forked elsewhere (tests/warm.py's server)."""
        self.clock.roots.append(pid)
        self.clock.tree.append(pid)

    def _sample(self):
        while not self.stop.wait(self.SAMPLE):
            self._take()

    def _take(self):
        own = self.clock.elapsed()
        self.samples.append((time.monotonic(), own))

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self._take()

    def _own_at(self, moment: float) -> float:
        """Own seconds at a time.time() moment inside the block, between the samples around it."""
        at = moment - self.epoch
        for (t0, own0), (t1, own1) in zip(self.samples, self.samples[1:]):
            if at <= t1:
                return own0 + (own1 - own0) * max(0.0, at - t0) / max(t1 - t0, 1e-9)
        return self.samples[-1][1]

    def own_between(self, start: float, end: float) -> float:
        """The world's own seconds from start to end, both time.time() moments inside the block: the wall seconds
        on an idle machine, fewer (at most OwnTime.SLOWEST times) where the world waited for a CPU then."""
        return self._own_at(end) - self._own_at(start)
