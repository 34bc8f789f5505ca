"""tests/warm.py does what `python ARGS` does, as the tests that use it rely on."""

import os
import subprocess
import sys

import pytest

from tests import warm

SCRIPT = """
import os, sys
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("WARM_TEST"))
print("path0", sys.path[0])
print("to stderr", file=sys.stderr)
import atexit
atexit.register(lambda: print("atexit ran"))
if sys.argv[1] == "raise":
    raise ValueError("from the script")
if sys.argv[1] == "hang":
    import time
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def script(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__main__.py").write_text(SCRIPT)
    return tmp_path


def test_a_script_gets_its_argv_cwd_environment_and_streams(script):
    done = warm.run(["script.py", "3", "x"], cwd=script, env=dict(os.environ, WARM_TEST="yes"))
    assert done.returncode == 3
    assert f"argv ['3', 'x'] cwd {script} env yes" in done.stdout
    assert f"path0 {script}" in done.stdout, "sys.path[0] is the script's folder"
    assert done.stdout.rstrip().endswith("atexit ran") and done.stderr == "to stderr\n"
    assert done.args == [sys.executable, "script.py", "3", "x"]


def test_a_module_runs_as_with_dash_m(script):
    done = warm.run(["-m", "pkg", "0"], cwd=script)
    assert done.returncode == 0 and f"path0 {script}" in done.stdout


def test_an_uncaught_exception_exits_1_with_its_traceback(script):
    done = warm.run(["script.py", "raise"], cwd=script)
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "ValueError: from the script" in done.stderr


def test_a_command_past_its_timeout_is_stopped(script):
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run(["script.py", "hang"], cwd=script, timeout=1)
    assert warm.run(["script.py", "0"], cwd=script).returncode == 0, "the server serves the next command"
