"""Set-up: make .venv and install what the course needs, the same way on Linux, macOS and Windows.

    python3 -m course setup                 # the .py exercises and grading: torch, numpy, pytest
    python3 -m course setup --notebooks     # and JupyterLab (exercises/*.ipynb), matplotlib (plots)

The instructors' repository offers a third level, --instructors: everything, nbgrader and ruff too.

`make setup` and `make notebooks` call it; Windows has no make. It runs on whatever Python the
student has, before anything is installed, so it imports only the standard library and keeps to
syntax that Python 3.6 parses: an old Python gets the one line below, not a SyntaxError.
"""

import argparse
import os
import re
import subprocess
import sys
import venv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, ".venv")

# Each level installs its requirements file (which includes the levels before it) and leaves a
# marker in .venv: the Makefile's set-up rules depend on the markers.
LEVELS = ("students", "notebooks", "instructors")
REQUIREMENTS = {
    "students": "requirements.txt",
    "notebooks": "requirements-notebooks.txt",
    "instructors": "requirements-instructors.txt",
}
MARKERS = {"students": ".installed", "notebooks": ".notebooks", "instructors": ".instructors"}
FIRST_COMMAND = {"students": "python mlp.py", "notebooks": "jupyter lab exercises/", "instructors": "make test"}


def needed_python(root=ROOT):
    """The oldest Python the course runs on: requires-python in pyproject.toml, as (major, minor)."""
    with open(os.path.join(root, "pyproject.toml")) as f:
        found = re.search(r'requires-python\s*=\s*">=(\d+)\.(\d+)"', f.read())
    return int(found.group(1)), int(found.group(2))


def version_problem(version=None, needed=None, executable=None):
    """One line saying what to install when this Python is too old for the course, else None."""
    version, needed, executable = version or sys.version_info, needed or needed_python(), executable or sys.executable
    if tuple(version[:2]) >= needed:
        return None
    want = "{}.{}".format(*needed)
    return "The course needs Python {} or newer; {} is Python {}.{}.{}. Install Python {} or newer (python.org) and run set-up with it, e.g. python{} -m course setup".format(
        want, executable, version[0], version[1], version[2], want, want
    )


def venv_python(venv_dir=VENV, platform=sys.platform):
    """The virtual environment's interpreter: Windows puts it in Scripts\\python.exe."""
    if platform == "win32":
        return os.path.join(venv_dir, "Scripts", "python.exe")
    return os.path.join(venv_dir, "bin", "python")


def activate_command(platform=sys.platform):
    """What a student types in each new terminal so that `python` is the course's."""
    if platform == "win32":
        return r".venv\Scripts\activate"
    return ". .venv/bin/activate"


def make_venv(venv_dir=VENV):
    try:
        venv.create(venv_dir, with_pip=True)
    except (subprocess.CalledProcessError, OSError) as error:
        # Debian and Ubuntu ship Python without ensurepip, which venv needs to install pip.
        sys.exit(
            "Could not make {}: {}. On Debian or Ubuntu: sudo apt install python3-venv, then run set-up again.".format(
                venv_dir, error
            )
        )


def pip_install(python, *args):
    done = subprocess.run([python, "-m", "pip", "install", "--quiet", *args])
    if done.returncode != 0:
        sys.exit("Set-up stopped: pip could not install {} (its message is above).".format(" ".join(args)))


def offered(level):
    """Whether this copy of the course has the level's requirements: the students' copy (make release)
    has no instructors' ones."""
    return os.path.isfile(os.path.join(ROOT, REQUIREMENTS[level]))


def setup(level="students", venv_dir=VENV):
    """Make venv_dir if needed and install `level` into it, with the course package itself."""
    problem = version_problem()
    if problem:
        sys.exit(problem)
    if not offered(level):
        sys.exit(
            "--{} is for the instructors' repository: this copy of the course has no {}".format(
                level, REQUIREMENTS[level]
            )
        )
    python = venv_python(venv_dir)
    if not os.path.exists(python):
        print("Making {} with Python {}.{}".format(venv_dir, *sys.version_info[:2]), flush=True)
        make_venv(venv_dir)
    requirements = REQUIREMENTS[level]
    print("Installing {} into {}: a minute or more the first time.".format(requirements, venv_dir), flush=True)
    pip_install(python, "-r", os.path.join(ROOT, requirements))
    pip_install(python, "--no-deps", "-e", ROOT)  # the course package, so workers import `course`
    for done in LEVELS[: LEVELS.index(level) + 1]:
        with open(os.path.join(venv_dir, MARKERS[done]), "w"):
            pass
    print("Ready. In each new terminal, first: {}   then: {}".format(activate_command(), FIRST_COMMAND[level]))


def add_arguments(parser):
    level = parser.add_mutually_exclusive_group()
    level.add_argument(
        "--notebooks",
        dest="level",
        action="store_const",
        const="notebooks",
        help="also JupyterLab (for exercises/*.ipynb) and matplotlib (plots)",
    )
    level.add_argument(
        "--instructors",
        dest="level",
        action="store_const",
        const="instructors",
        help="everything: nbgrader and ruff too" if offered("instructors") else argparse.SUPPRESS,
    )
    parser.set_defaults(level="students")


def main(args):
    setup(args.level)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
