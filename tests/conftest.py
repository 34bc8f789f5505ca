"""Test-suite settings. COURSE_IMPL picks the implementation under test (see course/impl.py)."""

import os

from course import env

# Before torch is imported (course/env.py says why).
os.environ.update(env.check_settings())

import pytest  # noqa: E402

from course import impl  # noqa: E402

# The suite starts its own worlds. Under srun or mpiexec (a CI job on a cluster) the launcher's
# variables would make every script the tests start join the launcher's world instead.
for name in env.LAUNCHER_VARIABLES:
    os.environ.pop(name, None)


@pytest.fixture(scope="session")
def impl_dir():
    """The folder whose mlp.py, dist.py and mydp.py are under test."""
    return impl.selected()
