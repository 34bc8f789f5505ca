"""Test-suite settings. COURSE_IMPL picks the implementation under test (see course/impl.py)."""

import os

# Before torch is imported: one thread per worker, so workers fork fast and share the cores
# (course/env.py); collectives are compared on every call and nothing waits long.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("COURSE_DEBUG", "1")
os.environ.setdefault("COURSE_TIMEOUT", "60")
os.environ.setdefault("COURSE_COLLECTIVE_TIMEOUT", "10")

import pytest  # noqa: E402

from course import env, impl  # noqa: E402

# The suite starts its own worlds. Under srun or mpiexec (a CI job on a cluster) the launcher's
# variables would make every script the tests start join the launcher's world instead.
for name in env.LAUNCHER_VARIABLES:
    os.environ.pop(name, None)


@pytest.fixture(scope="session")
def impl_dir():
    """The folder whose mlp.py, dist.py and mydp.py are under test."""
    return impl.selected()


@pytest.fixture(scope="session")
def ex(impl_dir):
    """The modules under test, loaded in this process: ex.mlp, ex.dist, ex.mydp."""
    return impl.load(impl_dir)
