"""The grader's files as they were before any check ran, to compare with at the end: a submission
that changes them (the checks, the course, any module the grader loaded, torch's included) fails
every check (README, "What a grade can be trusted for")."""

from __future__ import annotations

import hashlib
import os
import sys
import time

from course.grading.explain import OWN_FOLDERS
from course.layout import ROOT


def _own_files() -> dict:
    """sha256 of every file of the grader's own folders (not the bytecode Python writes there)."""
    digests = {}
    for folder in OWN_FOLDERS:
        for top, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                path = os.path.join(top, name)
                with open(path, "rb") as f:
                    digests[os.path.relpath(path, ROOT)] = hashlib.sha256(f.read()).hexdigest()
    return digests


def _loaded_files(attributes=("__file__", "__cached__")) -> dict:
    """Every file this process has loaded code from (sources, bytecode, extensions), with its
    inode, size, and modification and change times: an edit changes the ctime, which no one can set back."""
    stats = {}
    for module in list(sys.modules.values()):
        for path in (getattr(module, name, None) for name in attributes):
            if isinstance(path, str) and path not in stats:
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                stats[path] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return stats


class Fingerprint:
    """The grader's files as they were before any check ran, to compare with at the end."""

    def __init__(self):
        self.started_ns = time.time_ns()
        self.own = _own_files()
        self.loaded = _loaded_files()

    def changes(self) -> list:
        """What changed since, one line each; an empty list when nothing did."""
        own = _own_files()
        changed = sorted(path for path in self.own.keys() | own.keys() if self.own.get(path) != own.get(path))
        loaded = _loaded_files()
        changed += sorted(
            os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path
            for path, stat in self.loaded.items()
            if loaded.get(path) != stat
        )
        # A module first imported after the fingerprint: its source must be older than the
        # fingerprint (its bytecode may be new: Python writes it on first import).
        changed += sorted(
            path
            for path, stat in _loaded_files(("__file__",)).items()
            if path not in self.loaded and stat[3] > self.started_ns
        )
        return list(dict.fromkeys(changed))
