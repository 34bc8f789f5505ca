"""Test-suite settings. COURSE_IMPL picks the implementation under test (see course/impl.py)."""

import os
import sys

from course.runtime import env

# Before torch is imported (course/runtime/env.py says why).
os.environ.update(env.check_settings())
# pytest-xdist's processes each on cores of their own, with what they start: two worlds of several
# ranks on the same 2 cores made each other's collectives wait for the scheduler.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and hasattr(os, "sched_setaffinity"):
    _cores, _workers = sorted(os.sched_getaffinity(0)), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if len(_cores) >= _workers > 1:
        os.sched_setaffinity(0, _cores[int(_worker[2:]) :: _workers])
# The suite starts its own worlds. Under srun or mpiexec (a CI job on a cluster) the launcher's
# variables would make every script the tests start join the launcher's world instead.
for name in env.LAUNCHER_VARIABLES:
    os.environ.pop(name, None)
# Where the checks' workers come from multiprocessing's forkserver (macOS): its server starts now,
# with the environment above, so that its imports (torch: about 3 s of CPU) run beside this
# process's own instead of after them, at the first world.
if env.checks_start_method(sys.platform, env.usable_cores()) == "forkserver":
    import multiprocessing.forkserver  # not on Windows, which has no forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(env.FORKSERVER_PRELOAD)
    multiprocessing.forkserver.ensure_running()

import pytest  # noqa: E402

from course import impl  # noqa: E402
from course.runtime import workers  # noqa: E402


@pytest.fixture(scope="session")
def impl_dir():
    """The folder whose student files (course/layout.py) are under test."""
    return impl.selected()


def pytest_collection_finish(session):
    """Checks whose worlds import torch._dynamo (a rank's first optimizer does, and its first
    TorchDispatchMode): the parent imports it once instead of every rank (course/runtime/workers.py). A
    module whose worlds do neither says IMPORTS_DYNAMO = False."""
    if any(getattr(getattr(item, "module", None), "IMPORTS_DYNAMO", True) for item in session.items):
        workers.expect_many_worlds()
