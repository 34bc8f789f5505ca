"""The repository's own suite runs with the checks' settings: their conftest's (COURSE_IMPL picks the
implementation under test, see course/impl.py)."""

from checks.conftest import impl_dir, pytest_collection_finish  # noqa: F401 - pytest finds them here
