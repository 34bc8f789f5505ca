"""Submissions that try to change their own grade, and gain nothing.

Each test grades a copy of the grader (course/ and checks/, so a cheat that edits them cannot
damage this repository) on a submission: the untouched student files with a cheat appended to
one of them; a submission that solves nothing must still score 0, the grader must still write a
valid results.json, and its feedback says what happened where it can. Exercise 2 only: its checks
are the quickest.

Two kinds of cheat:
- In Python, inside the workers: patch the checks, the grader or torch, send a result that runs
  code when unpickled, print a table. Graded once, as the suite runs.
- Through the operating system (course/runtime/sandbox.py): kill, stop, read or write the grader's
  processes, their memory, descriptors and files, outlive them. Each is graded as root at the
  level this machine gives root, as root at the uid level (Gradescope's: a Python every user can
  read is needed), and as a normal user (a laptop, an instructor's machine): the ATTACKERS below.
  The graders run with COURSE_SANDBOX=required or uid, so a machine that allows no sandbox skips
  these tests and says why, rather than passing them unsandboxed. Each payload says on stderr
  what the system let it do, which a failure shows.
"""

import ctypes
import functools
import json
import os
import pathlib
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

import pytest

from course.exercises import STUDENT_FILES, by_number
from course.grading import points as course_checks
from course.instructors.student import ROOT, SOLUTIONS
from course.runtime import sandbox, uprobes
from tests import warm

# One of exercise 2's checks, or two: two make two grading processes (course/grading/plugin.py), so that the
# pipe from the copy to the grader is there to attack. -s: what a payload prints reaches stderr.
ONE_CHECK = ["-m", "course", "grade", "--ex", "2", "--", "-s", "-k", "test_by_row[2]"]
TWO_CHECKS = ["-m", "course", "grade", "--ex", "2", "--", "-s", "-k", "test_by_row[1] or test_by_row[2]"]
GRADER_NAME = "grader"  # the process name (comm) of the graders these tests start: what a cheat looks for


def _copy_grader(base, cheats, solved=ROOT):
    grader, submission = base / "grader", base / "submission"
    for folder in ("course", "checks"):
        shutil.copytree(os.path.join(ROOT, folder), grader / folder, ignore=shutil.ignore_patterns("__pycache__"))
    submission.mkdir()
    for name in STUDENT_FILES:
        shutil.copy(os.path.join(solved, name), submission)
    for name, text in cheats.items():
        with open(submission / name, "a") as f:
            f.write("\n" + text)
    return grader, submission


def grade(tmp_path, cheats, base=ROOT, ex=2):
    """Grade, in a copy of the grader, the files of `base` with each cheat appended to its file."""
    grader, submission = _copy_grader(tmp_path, cheats, base)
    done = warm.run(
        ["-m", "course", "grade", *(["--ex", str(ex)] if ex else [])],
        cwd=grader,
        env=dict(os.environ, COURSE_IMPL=str(submission)),
    )
    return done, grader / "results.json"


def results(path):
    with open(path) as f:
        found = json.load(f)
    assert {"score", "tests", "output"} <= found.keys()
    return found


EX2_CHECKS = len(course_checks.of_module("checks.test_ex02_dist"))


def assert_no_points(done, path, said="", checks=EX2_CHECKS):
    """0 points, a valid results.json, every check failed (by default all of exercise 2's), and
    `said` in their feedback."""
    assert done.returncode == 0, done.stdout + done.stderr
    found = results(path)
    assert found["score"] == 0 and [t["status"] for t in found["tests"]] == ["failed"] * checks, found
    assert re.search(said, " ".join(t["output"] for t in found["tests"])), found["tests"][0]["output"]
    assert "GRADER ERROR" not in done.stdout, done.stdout
    assert "25/25" not in done.stdout and "0/" in done.stdout, done.stdout
    return found


# ---- cheats in Python ---------------------------------------------------------------------------

# The cheat of issue 14: before, exercise 2 scored 25/25 with dist.py untouched.
ISSUE_14 = """
import sys as _sys
for _name, _mod in list(_sys.modules.items()):
    if _name.startswith("checks.test_ex"):
        for _k in dir(_mod):
            if _k.startswith("check_"):
                setattr(_mod, _k, lambda *a, **k: None)
"""

PATCH_GRADER = """
import course.grading.plugin as _grade
_grade.points_of = lambda item: 1000
_grade.Check.score = property(lambda self: self.max_score)
_grade.explain = lambda error: ""
_grade._Grader.pytest_runtest_logreport = lambda self, report: None
"""

# Wrong numbers of the right shape (dist.py's own imports: torch, dist).
WRONG_NUMBERS = """
def _product_shape(A, B):
    shape = torch.tensor([A.shape[0], B.shape[1]] if dist.get_rank() == 0 else [0, 0])
    dist.broadcast(shape, src=0)
    return tuple(shape.tolist())


def par_matmul_by_row(A, B):
    shape = _product_shape(A, B)
    return torch.zeros(shape) if dist.get_rank() == 0 else None


def par_matmul_by_reduction(A, B):
    return torch.zeros(_product_shape(A, B))
"""

# Wrong numbers, and torch's comparisons told to say they are equal.
PATCH_TORCH = (
    """
import torch
import torch.distributed as dist
torch.allclose = lambda *a, **k: True
torch.equal = lambda *a, **k: True
"""
    + WRONG_NUMBERS
)

EXIT_0 = "import os as _os\n_os._exit(0)\n"

FAKE_TABLE = """
import os as _os, sys as _sys
_table = "exercise   checks       points\\n       2      4/4        25/25\\n   total      4/4        25/25\\n"
print(_table)
_os.write(1, _table.encode())
_sys.__stderr__.write(_table)
"""

# A result whose unpickling runs code in the process that receives it.
EVIL_RESULT = """
class _Verdict:
    def __reduce__(self):
        return (exec, ("import course.grading.plugin as g; g.Check.passed = property(lambda s: True, lambda s, v: None)",))


def par_matmul_by_row(A, B):
    return _Verdict()


def par_matmul_by_reduction(A, B):
    return _Verdict()
"""


def test_the_cheat_of_issue_14_gains_nothing(tmp_path):
    assert_no_points(*grade(tmp_path, {"dist.py": ISSUE_14}), "par_matmul_by_row is not written yet")


def test_patching_the_grader_plugin_and_its_points_gains_nothing(tmp_path):
    assert_no_points(*grade(tmp_path, {"dist.py": PATCH_GRADER}), "par_matmul_by_row is not written yet")


def test_patching_torch_comparisons_gains_nothing(tmp_path):
    assert_no_points(*grade(tmp_path, {"dist.py": PATCH_TORCH}), "returned wrong numbers")


def test_a_worker_that_exits_0_without_a_result_gains_nothing(tmp_path):
    assert_no_points(*grade(tmp_path, {"dist.py": EXIT_0}), r"exit code 0|result")


def test_printing_a_fake_table_gains_nothing(tmp_path):
    done, path = grade(tmp_path, {"dist.py": FAKE_TABLE})
    assert_no_points(done, path, "par_matmul_by_row is not written yet")
    assert done.stdout.count("exercise   checks") == 1, done.stdout


def test_a_result_that_runs_code_when_unpickled_gains_nothing(tmp_path):
    assert_no_points(*grade(tmp_path, {"dist.py": EVIL_RESULT}))


def test_the_reference_scores_full_marks(tmp_path):
    """The control of the cheats above: the same grader, in the same copy, gives honest code exercise 2's
    points. (Every exercise's checks pass on the reference in the suite's own test_exN_*.py.)"""
    done, path = grade(tmp_path, {}, base=SOLUTIONS)
    assert done.returncode == 0, done.stdout + done.stderr
    found = results(path)
    assert found["score"] == 25 and all(t["status"] == "passed" for t in found["tests"]), done.stdout


def test_the_grader_files_fingerprint_catches_an_edit_where_there_is_no_sandbox(tmp_path):
    """Without a sandbox (macOS, a kernel without user namespaces) a worker can edit the checks on
    disk: the reference with that edit would score 25/25 if the grader did not notice."""
    grader, submission = _copy_grader(tmp_path, {"dist.py": EDIT_CHECKS + "_edit_checks()\n"}, SOLUTIONS)
    env = dict(os.environ, COURSE_IMPL=str(submission), COURSE_SANDBOX="off")
    done = warm.run(["-m", "course", "grade", "--ex", "2"], cwd=grader, env=env)
    assert_no_points(
        done, grader / "results.json", r"the grader's own files changed while it ran \(checks/test_ex02_dist.py\)"
    )
    assert "without a sandbox (COURSE_SANDBOX=off): this grade is advisory" in done.stdout, done.stdout


# ---- cheats through the operating system ------------------------------------------------------

# What every payload below starts with: the grading processes it can see (by process name, other
# than its own world's ranks: its parent's children), and a line on stderr for each thing it tries.
PRELUDE = f"""
import json as _json, os as _os, signal as _signal, sys as _sys

def _targets():
    found = []
    for _p in _os.listdir("/proc"):
        if not _p.isdigit() or int(_p) == _os.getpid():
            continue
        try:
            with open(f"/proc/{{_p}}/comm") as _f:
                _name = _f.read().strip()
            with open(f"/proc/{{_p}}/stat") as _f:
                _parent = int(_f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if _name == {GRADER_NAME!r} and _parent != _os.getppid():
            found.append(int(_p))
    return found

def _tried(what, act):
    try:
        act()
        print(f"CHEAT {{what}}: done", file=_sys.stderr, flush=True)
    except Exception as _e:
        print(f"CHEAT {{what}}: refused ({{type(_e).__name__}}: {{_e}})", file=_sys.stderr, flush=True)

_FAKE = {{"score": 160, "execution_time": 1, "output": "", "tests": []}}

def _forge(folder):
    with open(_os.path.join(folder, "results.json"), "w") as _f:
        _json.dump(_FAKE, _f)
"""

# results.json with full marks where the grader writes it, then the grader and its copy killed:
# Gradescope reads the file whatever the grader's exit status.
FORGE_THEN_KILL = """
_tried("forge results.json", lambda: _forge(_os.getcwd()))
for _pid in _targets():
    _tried(f"kill {_pid}", lambda: _os.kill(_pid, _signal.SIGKILL))
"""

# A daemon that forks and exits without pause, so that no snapshot of the processes holds it (a
# fresh small interpreter: a fork of a worker, torch and all, takes milliseconds), and rewrites
# results.json with full marks for 10 s, after the grader is gone.
CHAIN = """
import json, os, sys, time
with open("/proc/self/comm", "w") as f:
    f.write(sys.argv[2])  # its name, this test's own
fake = json.dumps({"score": 160, "execution_time": 1, "output": "", "tests": []})
end, n = time.time() + 10, 0
while time.time() < end:
    if os.fork():
        os._exit(0)
    n += 1
    if n % 100 == 0:
        try:
            with open(os.path.join(sys.argv[1], "results.json"), "w") as f:
                f.write(fake)
        except OSError:
            pass
"""
OUTRUNS_THE_REAPER = f"""
if _os.fork() == 0:
    _os.setsid()
    _os.execv(_sys.executable, [_sys.executable, "-c", {CHAIN!r}, _os.getcwd(), DAEMON_NAME])
"""

# SIGSTOP to the grader and its copy: a grader that waits for its copy for ever.
STOP_THE_GRADER = """
for _pid in _targets():
    _tried(f"stop {_pid}", lambda: _os.kill(_pid, _signal.SIGSTOP))
"""

# The grader's memory: workers are forks of it, so its objects sit at the same addresses. The
# constant 0.0 of Check.score ("the score of a failed check") becomes 6.25 in the grader's memory.
WRITE_ITS_MEMORY = """
import struct as _struct
import course.grading.plugin as _grade

_zero = next(c for c in _grade.Check.score.fget.__code__.co_consts if isinstance(c, float) and c == 0.0)

def _write(pid):
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as _mem:
        _mem.seek(id(_zero) + 16)  # a float's value: after its reference count and its type
        _mem.write(_struct.pack("d", 6.25))

for _pid in _targets():
    _tried(f"write the memory of {_pid}", lambda: _write(_pid))
"""

# The pipe that brings the copy's reports to the grader (both ends are reachable as
# /proc/PID/fd/N): reports of its own first, every check passed.
WRITE_ITS_PIPE = """
import pickle as _pickle
_nodeids = [f"checks/test_ex02_dist.py::test_{m}[{w}]" for m in ("by_row", "by_reduction") for w in (1, 2, 3, 4)]
_passed = [
    {"$report_type": "TestReport", "nodeid": n, "location": ["checks/test_ex02_dist.py", 1, n.split("::")[1]],
     "keywords": {}, "outcome": "passed", "longrepr": None, "when": when, "user_properties": [], "sections": [],
     "duration": 0.01, "start": 0.0, "stop": 0.01}
    for n in _nodeids for when in ("setup", "call", "teardown")
]
_message = _json.dumps({"reports": _passed, "changed": []}).encode()

def _write(path):
    fd = _os.open(path, _os.O_WRONLY | _os.O_NONBLOCK)
    try:
        _os.write(fd, _message)
        _os.write(fd, _pickle.dumps((_passed, [])))
    finally:
        _os.close(fd)

for _pid in _targets():
    try:
        _fds = _os.listdir(f"/proc/{_pid}/fd")
    except OSError as _e:
        print(f"CHEAT the descriptors of {_pid}: refused ({_e})", file=_sys.stderr, flush=True)
        continue
    for _fd in _fds:
        _path = f"/proc/{_pid}/fd/{_fd}"
        try:
            _pipe = _os.readlink(_path).startswith("pipe:")
        except OSError:
            continue
        if _pipe:
            _tried(f"write {_path}", lambda: _write(_path))
"""

# Bytecode for every module of the grader's own folders, valid for its source (its size and time):
# a module imported after submission code ran would run it, and it gives every check its points.
LATE_BYTECODE = """
import importlib.util as _util, marshal as _marshal
from course.layout import ROOT as _ROOT
_evil = "\\nimport course.grading.plugin as _g\\n_g.Check.score = property(lambda self: self.max_score)\\n"

def _plant(source):
    st = _os.stat(source)
    with open(source) as f:
        code = compile(f.read() + _evil, source, "exec")
    pyc = _util.cache_from_source(source)
    _os.makedirs(_os.path.dirname(pyc), exist_ok=True)
    header = _util.MAGIC_NUMBER + (0).to_bytes(4, "little") + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
    with open(pyc, "wb") as f:
        f.write(header + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little") + _marshal.dumps(code))

for _top, _dirs, _files in _os.walk(_os.path.join(_ROOT, "course")):
    for _name in _files:
        if _name.endswith(".py"):
            _tried(f"plant bytecode for {_name}", lambda: _plant(_os.path.join(_top, _name)))
"""

# The name the grader once wrote its results to before moving them into place, made a link.
PLANT_A_LINK = """
for _pid in _targets():
    _tried(f"link for {_pid}", lambda: _os.symlink("/tmp/course-cheat-victim", f".results.json.{_pid}.tmp"))
"""

# The checks, edited on disk: the grader would run the edited test module in later runs.
EDIT_CHECKS = """
import os as _os
from course.layout import ROOT as _ROOT

def _edit_checks():
    with open(_os.path.join(_ROOT, "checks", "test_ex02_dist.py"), "a") as _f:
        _f.write("\\n# a submission was here\\n")
"""

# A unix socket of the grader's user (multiprocessing's servers, which unpickle what they are sent; an
# SSH agent; the kernels' forkserver under autograde). Under namespaces, a read-only mount does not
# stop a connect(): the seccomp filter that refuses AF_UNIX sockets does.
REACH_A_UNIX_SOCKET = """
import socket as _socket

def _reach():
    with _socket.socket(_socket.AF_UNIX) as _s:
        _s.connect(SOCKET_PATH)
        _s.sendall(b"a pickle for the server")

_tried("connect to the grader's user's unix socket", _reach)
"""

ATTACKS = {
    "forge_then_kill": FORGE_THEN_KILL,
    "outruns_the_reaper": OUTRUNS_THE_REAPER,
    "stop_the_grader": STOP_THE_GRADER,
    "write_its_memory": WRITE_ITS_MEMORY,
    "write_its_pipe": WRITE_ITS_PIPE,
    "late_bytecode": LATE_BYTECODE,
    "plant_a_link": PLANT_A_LINK,
    "edit_checks": EDIT_CHECKS + '_tried("edit the checks on disk", _edit_checks)\n',
    "reach_a_unix_socket": REACH_A_UNIX_SOCKET,
}


@functools.cache
def _free_uid():
    """A uid of no account, outside the sandbox's range: the normal user these tests grade as."""

    def no_account(uid):
        try:
            pwd.getpwuid(uid)
            return False
        except KeyError:
            return True

    return next(uid for uid in range(61000, 62000) if no_account(uid))


@functools.cache
def readable_python():
    """This Python version as every user can run it (its standard library outside /root, say), with
    this environment's packages on PYTHONPATH; None if there is none. The uid level needs it, and
    so does a normal user's grader on a machine whose venv's Python lives under /root."""
    packages = sysconfig.get_paths()["purelib"]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for python in (sys.executable, f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"):
        if not os.path.exists(python):
            continue
        uid = _free_uid()

        def as_nobody(uid=uid):
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)

        # Where it finds its standard library, as root and as another user: a Python that cannot
        # read its own falls back to another one, which a process forked from root's would not.
        probe = "import os, secrets, numpy, sys; print(sys.version_info[:2], os.__file__)"
        env = dict(os.environ, PYTHONPATH=packages)
        found = [
            subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True, preexec_fn=drop)
            for drop in (None, as_nobody)
        ]
        same = found[0].stdout == found[1].stdout and found[1].returncode == 0
        if same and found[0].stdout.startswith(str(tuple(sys.version_info[:2]))):
            return python, packages
    return None


def _who(name):
    """(python, user, COURSE_SANDBOX, PYTHONPATH) of a configuration, or a reason to skip it."""
    if not sandbox.LINUX:
        return f"no sandbox on {sys.platform}"
    root = os.geteuid() == 0
    if name == "root":
        return (sys.executable, None, "required", "") if root else "the grader runs as a normal user here"
    readable = readable_python() if root else (sys.executable, "")
    if readable is None:
        return "no Python every user can read here (the venv's lives where only root can read)"
    python, packages = readable
    if name == "root, uid level":
        return (python, None, "uid", packages) if root else "the uid level needs root"
    return python, (_free_uid(), _free_uid()) if root else None, "required", packages


ATTACKERS = ["root", "root, uid level", "a normal user"]


@pytest.fixture
def attacked(request):
    """A folder every user can enter, owned by the grader's user, removed afterwards; and the grader's settings."""
    who = _who(request.param)
    if isinstance(who, str):
        pytest.skip(who)
    base = tempfile.mkdtemp(prefix="course-cheat-")
    os.chmod(base, 0o755)
    yield base, who
    shutil.rmtree(base, ignore_errors=True)


def grade_as(base, who, cheats, args=ONE_CHECK, timeout=120, files=None):
    """Grade the stubs with cheats appended, as `who` says, in the grader's copy with files
    ({name: text}) added; (done, results.json's path)."""
    python, user, mode, packages = who
    grader, submission = _copy_grader(pathlib.Path(base), cheats)
    for name, text in (files or {}).items():
        (grader / name).write_text(text)
    if user is not None:
        for top, dirs, files in os.walk(base):
            for name in [top, *(os.path.join(top, n) for n in dirs + files)]:
                os.lchown(name, *user)
    env = dict(os.environ, COURSE_IMPL=str(submission), COURSE_SANDBOX=mode)
    if packages:
        env["PYTHONPATH"] = packages
    done = warm.run([*args], cwd=grader, env=env, python=python, user=user, name=GRADER_NAME, timeout=timeout)
    return done, grader / "results.json"


def _outermost_grader(pid):
    """The first grading process (GRADER_NAME) that pid descends from: not its forked copy; None if none."""
    found = None
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            break
        if stat[stat.index("(") + 1 : stat.rindex(")")] == GRADER_NAME:
            found = pid
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def _daemons(name):
    """Live processes of that name (zombies do nothing)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if f"({name})" in stat and stat.rsplit(")", 1)[1].split()[0] != "Z":
            found.append(int(pid))
    return found


@pytest.mark.parametrize("attacked", ATTACKERS, indirect=True)
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_an_attack_through_the_system_gains_nothing(attacked, attack):
    base, who = attacked
    checks = 2 if attack == "write_its_pipe" else 1
    daemon = f"daemon-{os.urandom(4).hex()}"  # a name of this test's own: tests run side by side
    server = socket.socket(socket.AF_UNIX)  # what REACH_A_UNIX_SOCKET tries to reach: anyone may connect
    server.bind(os.path.join(base, "server.sock"))
    os.chmod(os.path.join(base, "server.sock"), 0o777)
    server.listen()
    server.setblocking(False)
    payload = f"DAEMON_NAME = {daemon!r}\nSOCKET_PATH = {server.getsockname()!r}\n" + PRELUDE + ATTACKS[attack]
    with server:
        done, path = grade_as(base, who, {"dist.py": payload}, args=[ONE_CHECK, TWO_CHECKS][checks - 1])
        with pytest.raises(BlockingIOError):  # no connection is waiting
            server.accept()
    said = "\n".join(line for line in done.stderr.splitlines() if line.startswith("CHEAT")) or "(nothing)"
    assert_no_points(done, path, "par_matmul_by_row is not written yet", checks=checks)
    assert "Submission code ran sandboxed" in done.stdout, done.stdout
    if attack == "outruns_the_reaper":
        for _ in range(20):  # had it survived the grader, it would rewrite results.json every 2 ms
            assert not _daemons(daemon), f"a daemon outlived the grader; what the payload could do:\n{said}"
            time.sleep(0.05)
        assert results(path)["score"] == 0, said
    if attack == "edit_checks":
        with open(os.path.join(base, "grader", "checks", "test_ex02_dist.py")) as f:
            assert "a submission was here" not in f.read(), said
    if attack == "plant_a_link":
        assert not os.path.exists("/tmp/course-cheat-victim"), said
    assert " done" not in said or attack in ("outruns_the_reaper",), f"the system let the payload do:\n{said}"


# A submission that spins for ever under a name of its own, so that the test can look for it.
SPIN = """
import ctypes as _ctypes
_ctypes.CDLL(None).prctl(15, {name!r}.encode(), 0, 0, 0)  # PR_SET_NAME
while True:
    pass
"""


@pytest.mark.parametrize("attacked", ATTACKERS, indirect=True)
def test_a_grader_killed_from_outside_leaves_a_failing_results_json(attacked):
    """Gradescope's time limit, say: the results.json written before any check says 0, and why; and
    the workers spinning in submission code die with the grader (a worker that changed its user
    lost the parent-death signal until the sandbox set it again)."""
    base, who = attacked
    spinner = f"spin-{os.urandom(4).hex()}"
    seen, grading = [], threading.Event()

    def watch():  # the spinners must have run before the kill, or the last assert proves nothing
        while not grading.is_set() and not seen:
            seen.extend(_daemons(spinner))
            time.sleep(0.05)
        graders = [_outermost_grader(pid) for pid in seen]
        for pid in set(filter(None, graders)):  # the time limit, as soon as submission code spins
            os.kill(pid, signal.SIGKILL)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        done, _ = grade_as(base, who, {"dist.py": SPIN.format(name=spinner)}, timeout=60)
    finally:
        grading.set()
        watcher.join()
    assert done.returncode != 0, done.stdout + done.stderr
    found = results(pathlib.Path(base) / "grader" / "results.json")
    assert found["score"] == 0 and "did not finish" in found["output"], found
    assert seen, "no worker reached the submission's loop before the grader was killed"
    deadline = time.monotonic() + 30  # they end at the grader's death; a loaded machine may take seconds to unmap them
    while _daemons(spinner) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = _daemons(spinner)
    for pid in survivors:  # a failed test leaves no spinning process behind
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"workers outlived the grader that was killed: {survivors}"


# The kernel's side of a notebook's check (course/grading/in_notebook.py): its checks process holds a
# socket to the kernel. A worker takes it (pidfd_getfd) and answers first: "passed".
STEAL_THE_KERNELS_SOCKET = """
import ctypes as _ctypes, stat as _stat, struct as _struct
_libc = _ctypes.CDLL(None, use_errno=True)
_answer = _json.dumps({"verdict": "", "facts": None}).encode()

def _steal(pid):
    pidfd = _os.pidfd_open(pid)
    try:
        for fd in range(3, 64):
            got = _libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd
            if got < 0:
                if _ctypes.get_errno() == 1:
                    raise PermissionError("pidfd_getfd: operation not permitted")
                continue
            if _stat.S_ISSOCK(_os.fstat(got).st_mode):
                _os.write(got, _struct.pack("!i", len(_answer)) + _answer)
            _os.close(got)
    finally:
        _os.close(pidfd)

for _pid in _targets():
    _tried(f"take the sockets of {_pid}", lambda: _steal(_pid))
"""

KERNEL = """
import json
from course.grading.in_notebook import CheckFailed, check
from checks.test_ex02_dist import check_by_row
try:
    check(check_by_row, world_size=2)
    print(json.dumps("passed"))
except CheckFailed as failed:
    print(json.dumps(str(failed)))
"""


@pytest.mark.parametrize("attacked", ATTACKERS, indirect=True)
def test_taking_the_notebook_kernels_socket_gains_nothing(attacked):
    """What the kernel of `make autograde` (or a student's notebook) does for each check cell."""
    base, who = attacked
    cheat = {"dist.py": PRELUDE + STEAL_THE_KERNELS_SOCKET}
    done, _ = grade_as(base, who, cheat, args=["kernel.py"], files={"kernel.py": KERNEL})
    said = "\n".join(line for line in done.stderr.splitlines() if line.startswith("CHEAT")) or "(nothing)"
    assert done.returncode == 0, done.stdout + done.stderr
    verdict = json.loads(done.stdout.strip().splitlines()[-1])
    assert "par_matmul_by_row is not written yet" in verdict, f"{verdict}; what the payload could do:\n{said}"
    assert " done" not in said, f"the system let the payload do:\n{said}"


# ---- issue 36: a worker's reply is data the judge validates, a failure pays only when the grader saw it ----

# The worker rewrites what it sends back: where the probe failed (a stub), an empty list as its result.
REWRITE_REPLIES = """
import course.runtime.worker as _worker

_real_data = _worker.as_data


def _as_data(message):
    if message[0] == "error":
        message = ("ok", {"result": [], "imported": []})  # a reply as a call sends one
    return _real_data(message)


_worker.as_data = _as_data
"""

# A hang made up by the worker: rank 0 raises what a rank stopped in a collective of data.py would, rank 1 returns
# after its 6 steps. Before, exercise 8's check believed those facts and paid.
MADE_UP_HANG = """
import torch.distributed as _dist


def train_shard(model, optimizer, X, Y, shard, batch, steps=None, average=None):
    if _dist.get_rank() == 0:
        raise RuntimeError(
            "Detected mismatch between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint("
            "SequenceNumber=7, OpType=ALLREDUCE, TensorShape=[10, 12], TensorDtypes=Float)"
        )
    return 6
"""


def grade_only(tmp_path, cheats, args, base=ROOT):
    """Grade, in a copy of the grader, the files of `base` with each cheat appended: course grade's args."""
    grader, submission = _copy_grader(tmp_path, cheats, base)
    done = warm.run(["-m", "course", "grade", *args], cwd=grader, env=dict(os.environ, COURSE_IMPL=str(submission)))
    assert done.returncode == 0 and "GRADER ERROR" not in done.stdout, done.stdout + done.stderr
    return results(grader / "results.json")


def test_rewritten_replies_gain_nothing(tmp_path):
    """Issue 36: the stubs with this cheat scored 71/370, 19 checks among them exercise 5's ring and exercise
    12's. Each check now fails, naming what came back where it expected what."""
    # In the files that the two exercises' checks load: dist.py (the ring) and mlp.py (cost.py imports it).
    found = grade_only(tmp_path, {"dist.py": REWRITE_REPLIES, "mlp.py": REWRITE_REPLIES}, ["--ex", "5", "--ex", "12"])
    cases = sum(len(course_checks.of_module(m)) for m in ("checks.test_ex05_ring", "checks.test_ex12_cost"))
    assert found["score"] == 0 and len(found["tests"]) == cases, found
    for test in found["tests"]:
        assert test["status"] == "failed", test
        assert re.search(r"the submission returned an empty list where the check expects a", test["output"]), test


def test_a_made_up_hang_gains_nothing(tmp_path):
    """Issue 36: exercise 8's unbalanced shards check paid for a hang the worker described. It pays only for one
    the grader saw (its own clock ran out, the stacks it sampled): the made-up one earns 0, the reference 2."""
    args = ["--ex", "8", "--", "-k", "test_unbalanced_hang"]
    found = grade_only(tmp_path / "cheat", {"data.py": MADE_UP_HANG}, args)
    assert found["score"] == 0 and [t["status"] for t in found["tests"]] == ["failed"], found
    assert "the world should hang in a collective that rank 1 never joins, and it ended" in found["tests"][0]["output"]
    reference = grade_only(tmp_path / "reference", {}, args, base=SOLUTIONS)
    assert reference["score"] == 2 and [t["status"] for t in reference["tests"]] == ["passed"], [
        t["output"] for t in reference["tests"]
    ]  # the check's own sentence: a failure once, under the suite's load, showed only the grade's table


# Issue 47: the stubs' dist.py, which, on import, replaces the probe that exercise 2's checks send by
# name with one that computes the expected answers itself (the checks' own seeded operands) and counts
# no work; its functions return None. Where a kept world runs each call in the process of the call
# before, this earns 14/25: every world's first call fails (a wrong answer, the world kept) and every
# later one runs the forgery.
FORGED_PROBE = """
import sys as _sys

import torch as _torch
import torch.distributed as _dist

_checks = _sys.modules.get("checks.test_ex02_dist")


def _forged(folder, method, given):
    _rank = _dist.get_rank()
    _out = []
    for _i in range(len(_checks.SHAPES)):
        _A, _B = _checks.operands(_i)
        _mine = _rank == 0 or method == "par_matmul_by_reduction"
        _out.append((_A @ _B if _mine else None, 0))
    return _out


if _checks is not None:
    _checks.multiply_everything = _forged
    _checks.multiply_everything.__module__ = "checks.test_ex02_dist"
    print("CHEAT forged the probe", file=_sys.stderr, flush=True)


# Functions that return without a collective: the call that installs the forgery succeeds, with wrong
# numbers, so that its world is kept for the checks after it.
def par_matmul_by_row(A, B):
    return None


def par_matmul_by_reduction(A, B):
    return None
"""


@pytest.mark.parametrize("for_credit", [True, False], ids=["for credit", "feedback"])
def test_a_probe_forged_for_the_calls_after_gains_nothing_where_the_grade_counts(tmp_path, for_credit):
    """Issue 47: where the grade counts (COURSE_FOR_CREDIT: Gradescope, make autograde), each call runs in a
    process forked for it from a worker that never ran submission code, so a probe replaced by one call is
    the checks' own in the next: the forgery earns what the stubs earn, 0. The control: a student's own
    grade (feedback, whose grader the student controls anyway) shares a worker's process between calls,
    and there the forgery pays, as it did everywhere before."""
    grader, submission = _copy_grader(tmp_path, {"dist.py": FORGED_PROBE})
    command = ["-m", "course", "grade", "--ex", "2", "--", "-s"]  # -s: what the forgery prints reaches stderr
    # forkserver: the grader runs every check in one process (with fork, in two), so that each world
    # of the control serves more than one check.
    environ = dict(os.environ, COURSE_IMPL=str(submission), COURSE_START_METHOD="forkserver")
    environ["COURSE_FOR_CREDIT"] = "1" if for_credit else ""
    done = warm.run(command, cwd=grader, env=environ)
    assert "CHEAT forged the probe" in done.stderr, "the attack ran"
    if for_credit:
        assert_no_points(done, grader / "results.json", r"par_matmul_by_\w+ should return")
    else:
        assert results(grader / "results.json")["score"] == 14, (
            "the control: the attack pays where calls share a process"
        )


# Parameters that the owners never share: each rank keeps its own, which is wrong; and torch's
# ZeroRedundancyOptimizer, which the check compares with, replaced by the same mistake. Before, the
# reference ran in the kept world where this file had been imported, and the forgery paid.
FORGED_REFERENCE = """
import torch.distributed.optim as _torch_optim

ShardedOptimizer.share_parameters = lambda self: None


class _Forged(ShardedOptimizer):
    def __init__(self, params, optimizer_class, **defaults):
        super().__init__(params, optimizer_class, **defaults)
        self.optim = self.optimizer


_torch_optim.ZeroRedundancyOptimizer = _Forged
"""


def test_a_forged_reference_gains_nothing(tmp_path):
    """Issue 36: a reference is computed in a world that never loaded submission code, so torch patched by a
    submission in its own world cannot forge it: the forgery earns 0, the reference full marks. Since issue 47 the
    forgery fails first for reaching ZeroRedundancyOptimizer at all, which exercise 11 forbids (the reference's own
    world is test_judges' business)."""
    args = ["--ex", "11", "--", "-k", "test_matches_zero_redundancy"]
    found = grade_only(tmp_path / "cheat", {"zero.py": FORGED_REFERENCE}, args, base=SOLUTIONS)
    assert found["score"] == 0 and [t["status"] for t in found["tests"]] == ["failed"], found
    said = found["tests"][0]["output"]
    assert "used torch's ZeroRedundancyOptimizer" in said, found["tests"]
    reference = grade_only(tmp_path / "reference", {}, args, base=SOLUTIONS)
    assert reference["score"] == 4 and [t["status"] for t in reference["tests"]] == ["passed"], reference


# ---- one student cannot stop the class (issue 36) ---------------------------------------------
# A kept worker's timer writes into the output its check gave it (a notebook kernel's), long after
# the check: into the probe that autograding runs in each kernel after its last cell, which it once
# read as printed JSON; the error ended grading for the whole class. Its functions return wrong
# numbers without raising, so that its worlds are kept.
TIMER_INTO_THE_OUTPUT = (
    """
import os as _os, signal as _signal

_out = _os.dup(1)


def _garbage(signum, frame):
    try:
        _os.write(_out, b"{ CHEAT: not the probe's JSON\\n")
    except OSError:
        pass


_signal.signal(_signal.SIGALRM, _garbage)
_signal.setitimer(_signal.ITIMER_REAL, 0.002, 0.002)
"""
    + WRONG_NUMBERS
)


def test_a_timer_that_writes_into_the_kernels_output_stops_no_one(tmp_path):
    """Graded by `course grade`, the cheater scores 0 for its wrong numbers. (Autograded beside its
    classmates, it scores 0 too, and their feedback is their own: test_autograde_end_to_end's timer.)"""
    assert_no_points(*grade(tmp_path / "grade", {"dist.py": TIMER_INTO_THE_OUTPUT}), "returned wrong numbers")


def _shown(data):
    return {"output_type": "display_data", "data": data, "metadata": {}}


def _printed(text):
    return {"output_type": "stream", "name": "stdout", "text": text}


@pytest.mark.parametrize(
    "probe, reason",
    [
        ([_printed("{ not JSON")], "could not be probed"),
        ([_printed("[]")], "could not be probed"),  # printed, as any worker holding the output can
        ([_shown({"text/plain": "[]"})], "could not be probed"),
        ([_printed("{ not JSON"), _shown({"PROBE": []})], ""),
        ([_shown({"PROBE": ["mlp"]})], r"held the submission's code \(mlp\)"),
        ([_shown({"PROBE": {"held": 1}})], "could not be probed"),
    ],
    ids=["garbage", "printed", "another_type", "garbage_beside", "held", "malformed"],
)
def test_what_a_kernels_probe_shows_costs_its_own_student_only(tmp_path, monkeypatch, probe, reason):
    """Whatever the last probe of a kernel shows, execute() returns: a probe that does not prove the
    kernel clean fails that student's checks with the reason (their class is graded: autograde's
    asyncio.gather goes on); one that does leaves the cells as they ran."""
    import asyncio

    import nbclient
    import nbformat

    from course.instructors.autograde import PROBE_MIME, execute
    from tests.grading.test_autograde import _Kernels

    probe = [dict(o, data={PROBE_MIME: o["data"]["PROBE"]}) if "PROBE" in o.get("data", {}) else o for o in probe]
    path = tmp_path / "submitted" / "s" / "ex1" / "01_mlp.ipynb"
    path.parent.mkdir(parents=True)
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")]), path)
    monkeypatch.setattr(nbclient, "NotebookClient", _Kernels([None], probe))
    asyncio.run(execute(str(tmp_path), "s", {"ex1": "01_mlp"}, str(tmp_path), 60))
    outputs = nbformat.read(path, as_version=4).cells[0].outputs
    if not reason:
        assert outputs == [], outputs
    else:
        assert [o["ename"] for o in outputs] == ["NotGraded"], outputs
        assert re.search(reason, outputs[0]["evalue"]), outputs[0]["evalue"]


# ---- a view per submission, a network per world (issue 36) ------------------------------------
#
# A submission's workers see the course's public files and that submission only (course/runtime/sandbox.py's
# view): not solutions/ of the instructors' repository it is graded in, not a classmate's folder
# beside it. Each world has a network of its own at every level: no listener of another world (a
# classmate's gloo ranks) is reachable. Each cheat is graded through `course grade` and through
# autograde at every level this machine gives, and, as the control that proves the attack, with
# COURSE_SANDBOX=off, where it pays.

# Exercise 2's functions taken from the reference (solutions/, beside the grader's course/).
READ_THE_REFERENCE = """
import importlib.util as _util, os as _os, sys as _sys


def _take(path):
    _spec = _util.spec_from_file_location("_taken_dist", path)
    _module = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    return _module


try:
    from course.layout import SOLUTIONS as _SOLUTIONS

    _taken = _take(_os.path.join(_SOLUTIONS, "dist.py"))
    par_matmul_by_row, par_matmul_by_reduction = _taken.par_matmul_by_row, _taken.par_matmul_by_reduction
    print("CHEAT read the reference: done", file=_sys.stderr, flush=True)
except Exception as _e:
    print(f"CHEAT read the reference: refused ({type(_e).__name__}: {_e})", file=_sys.stderr, flush=True)
"""

# Exercise 2's functions taken from a classmate: any folder beside this submission's with a dist.py.
READ_A_CLASSMATE = """
import importlib.util as _util, os as _os, sys as _sys

_mine = _os.path.dirname(_os.path.abspath(__file__))
_around = _os.path.dirname(_mine)
try:
    for _name in sorted(_os.listdir(_around)):
        _path = _os.path.join(_around, _name, "dist.py")
        if _os.path.join(_around, _name) != _mine and _os.path.isfile(_path):
            _spec = _util.spec_from_file_location("_taken_dist", _path)
            _taken = _util.module_from_spec(_spec)
            _spec.loader.exec_module(_taken)
            par_matmul_by_row, par_matmul_by_reduction = _taken.par_matmul_by_row, _taken.par_matmul_by_reduction
            print(f"CHEAT read a classmate ({_path}): done", file=_sys.stderr, flush=True)
            break
    else:
        print(f"CHEAT read a classmate: refused (no classmate in {_around})", file=_sys.stderr, flush=True)
except Exception as _e:
    print(f"CHEAT read a classmate: refused ({type(_e).__name__}: {_e})", file=_sys.stderr, flush=True)
"""

# A listener of the machine's loopback (what a classmate's gloo ranks open), connected to from a
# worker: first the one the test names, then any that /proc/net/tcp lists.
REACH_A_LISTENER = """
import os as _os, socket as _socket, sys as _sys

def _listeners():
    with open("/proc/net/tcp") as _f:
        return [int(l.split()[1].split(":")[1], 16) for l in list(_f)[1:] if l.split()[3] == "0A"]


def _reach():
    with _socket.create_connection(("127.0.0.1", PORT), timeout=2) as _s:
        _s.sendall(b"a rank of another world")


print(f"CHEAT listeners seen: {sorted(set(_listeners()))}", file=_sys.stderr, flush=True)
try:
    _reach()
    print("CHEAT connect to another world's listener: done", file=_sys.stderr, flush=True)
except OSError as _e:
    print(f"CHEAT connect to another world's listener: refused ({_e})", file=_sys.stderr, flush=True)
"""

VIEW_CHEATS = {"reads_the_reference": READ_THE_REFERENCE, "reads_a_classmate": READ_A_CLASSMATE}


def _reaching(listener):
    return f"PORT = {listener.port}\n" + REACH_A_LISTENER


class _Listener:
    """A TCP listener on the machine's loopback that counts the connections it is offered; on a port
    below the kernel's ephemeral range, which no world's own gloo socket can take in its own network (a
    cheat that connected to one of those, by chance of the same number, read as reaching this one)."""

    def __init__(self):
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
        for port in random.sample(range(low // 2, low), 200):
            try:
                self.socket = socket.create_server(("127.0.0.1", port))
                break
            except OSError:  # taken
                continue
        else:
            raise OSError(f"no free port below {low}")
        self.socket.setblocking(False)
        self.port = self.socket.getsockname()[1]

    def reached(self) -> bool:
        try:
            self.socket.accept()[0].close()
            return True
        except BlockingIOError:
            return False

    def close(self):
        self.socket.close()


def _as_user(base, who):
    """base and what is in it made the grader's user's, as grade_as does."""
    user = who[1]
    if user is not None:
        for top, dirs, files in os.walk(base):
            for name in [top, *(os.path.join(top, n) for n in dirs + files)]:
                os.lchown(name, *user)


def _instructors_repository(base, cheats, solved=ROOT):
    """A grader's copy with solutions/ (the instructors' repository), the files of solved (the stubs) with
    cheats as the submission, and a correct classmate beside it; (grader, submission)."""
    grader, submission = _copy_grader(pathlib.Path(base), cheats, solved)
    shutil.copytree(SOLUTIONS, grader / "solutions", ignore=shutil.ignore_patterns("__pycache__"))
    classmate = pathlib.Path(base) / "classmate"
    classmate.mkdir()
    for name in STUDENT_FILES:
        shutil.copy(os.path.join(SOLUTIONS, name), classmate)
    return grader, submission


def _grade_in_repository(base, who, cheats, ex=2, solved=ROOT, checks=(), credit=False):
    python, user, mode, packages = who
    grader, _ = _instructors_repository(base, cheats, solved)
    _as_user(base, who)
    env = dict(os.environ, COURSE_IMPL=str(pathlib.Path(base) / "submission"), COURSE_SANDBOX=mode)
    if credit:
        env["COURSE_FOR_CREDIT"] = "1"
    if packages:
        env["PYTHONPATH"] = packages
    done = warm.run(
        ["-m", "course", "grade", "--ex", str(ex), "--", "-s", *checks],
        cwd=grader,
        env=env,
        python=python,
        user=user,
        timeout=240,
    )
    said = "\n".join(line for line in done.stderr.splitlines() if line.startswith("CHEAT")) or "(nothing)"
    return done, grader / "results.json", said


@pytest.mark.parametrize("attacked", ATTACKERS, indirect=True)
@pytest.mark.parametrize("cheat", sorted(VIEW_CHEATS))
def test_reading_the_reference_or_a_classmate_gains_nothing(attacked, cheat):
    base, who = attacked
    done, path, said = _grade_in_repository(base, who, {"dist.py": VIEW_CHEATS[cheat]})
    assert_no_points(done, path, "par_matmul_by_row is not written yet")
    assert "in a view of the course's public files and its own submission" in done.stdout, done.stdout
    assert "done" not in said and "refused" in said, f"what the payload could do:\n{said}"


@pytest.mark.parametrize("cheat", sorted(VIEW_CHEATS))
def test_reading_the_reference_or_a_classmate_pays_without_the_view(tmp_path, cheat):
    """The control: the same cheat, graded with COURSE_SANDBOX=off, takes exercise 2's full marks."""
    os.chmod(tmp_path, 0o755)
    done, path, said = _grade_in_repository(
        tmp_path, (sys.executable, None, "off", ""), {"dist.py": VIEW_CHEATS[cheat]}
    )
    assert results(path)["score"] == 25, done.stdout + said
    assert "done" in said, said


@pytest.mark.parametrize("attacked", ATTACKERS, indirect=True)
def test_reaching_another_worlds_listener_gains_nothing(attacked):
    base, who = attacked
    listener = _Listener()
    try:
        done, path, said = _grade_in_repository(base, who, {"dist.py": _reaching(listener)})
        assert not listener.reached(), f"a worker reached a listener of the machine's network:\n{said}"
    finally:
        listener.close()
    assert_no_points(done, path, "par_matmul_by_row is not written yet")
    assert "refused" in said and "done" not in said, said


def test_reaching_another_worlds_listener_succeeds_without_a_network_of_its_own(tmp_path):
    """The control: with COURSE_SANDBOX=off the worker reaches the machine's listener."""
    os.chmod(tmp_path, 0o755)
    listener = _Listener()
    try:
        done, _, said = _grade_in_repository(
            tmp_path, (sys.executable, None, "off", ""), {"dist.py": _reaching(listener)}
        )
        assert listener.reached(), said
    finally:
        listener.close()
    assert "connect to another world's listener: done" in said, said


# Issue 47: a System V shared memory segment made in a worker (1 MiB, a key of the test's own): in the
# machine's IPC namespace it outlived the grade, and a later student's world could attach it (a channel
# between students, and memory never given back). Each world has an IPC namespace of its own now.
MAKE_A_SEGMENT = """
import ctypes as _ctypes, sys as _sys
_made = _ctypes.CDLL(None, use_errno=True).shmget(SEGMENT_KEY, 1 << 20, 0o1000 | 0o666)  # IPC_CREAT
print(f"CHEAT make a System V segment: {'done' if _made >= 0 else 'refused'}", file=_sys.stderr, flush=True)
"""


def _segment(key):
    """Whether the machine's IPC namespace (this process's) holds a segment of that key; removed if so."""
    libc = ctypes.CDLL(None, use_errno=True)
    found = libc.shmget(key, 0, 0)
    if found >= 0:
        libc.shmctl(found, 0, None)  # IPC_RMID
    return found >= 0


@pytest.mark.parametrize("attacked", ATTACKERS, indirect=True)
def test_a_system_v_segment_does_not_outlive_its_world(attacked):
    base, who = attacked
    key = random.randrange(1 << 20, 1 << 30)
    done, path, said = _grade_in_repository(base, who, {"dist.py": f"SEGMENT_KEY = {key}\n" + MAKE_A_SEGMENT})
    assert "make a System V segment: done" in said, said  # in the world's own namespace
    assert not _segment(key), f"a worker's segment outlived its world in the machine's namespace:\n{said}"
    assert_no_points(done, path, "par_matmul_by_row is not written yet")


def test_a_system_v_segment_outlives_its_world_without_a_sandbox(tmp_path):
    """The control: with COURSE_SANDBOX=off the segment is the machine's, after the grade."""
    os.chmod(tmp_path, 0o755)
    key = random.randrange(1 << 20, 1 << 30)
    cheat = {"dist.py": f"SEGMENT_KEY = {key}\n" + MAKE_A_SEGMENT}
    done, _, said = _grade_in_repository(tmp_path, (sys.executable, None, "off", ""), cheat)
    assert _segment(key), said


# Issue 47: a grading job's secret in the grader's environment, read by a worker (and printable into its
# feedback). Sandboxed workers get an environment built for them.
READ_THE_GRADERS_ENVIRONMENT = """
import os as _os, sys as _sys
_found = _os.environ.get("GRADING_JOB_TOKEN")
print(f"CHEAT read the grader's environment: {'done' if _found else 'refused'}", file=_sys.stderr, flush=True)
"""


@pytest.mark.parametrize("attacked", ATTACKERS, indirect=True)
def test_a_worker_does_not_see_the_graders_environment(attacked, monkeypatch):
    base, who = attacked
    monkeypatch.setenv("GRADING_JOB_TOKEN", "a secret")
    done, path, said = _grade_in_repository(base, who, {"dist.py": READ_THE_GRADERS_ENVIRONMENT})
    assert "read the grader's environment: refused" in said and "done" not in said, said
    assert_no_points(done, path, "par_matmul_by_row is not written yet")


def test_a_worker_sees_the_graders_environment_without_a_sandbox(tmp_path, monkeypatch):
    """The control: with COURSE_SANDBOX=off the worker reads it."""
    os.chmod(tmp_path, 0o755)
    monkeypatch.setenv("GRADING_JOB_TOKEN", "a secret")
    cheat = {"dist.py": READ_THE_GRADERS_ENVIRONMENT}
    _, _, said = _grade_in_repository(tmp_path, (sys.executable, None, "off", ""), cheat)
    assert "read the grader's environment: done" in said, said


# Issue 47: evidence written in the worker. Exercise 5's inputs are made the check's way (rank_tensor, which
# the workers can import): each rank computes the sum of every rank's tensor by itself, exchanges nothing,
# and makes the communication log say what a ring sends. Every bound the log gave holds; the bytes the
# world's own network carried, which the grader reads from the kernel, are far below what any all-reduce
# sends.
# What a ring's communication log says, forged: a ring's sends to one neighbour, and no collective.
FORGED_LOG = """
import checks.comm_log as _log

_said = {}
_summary = _log.CommLog.summary
_log.CommLog.summary = lambda self: {**_summary(self), **_said}


def _as_a_ring_sends(tensor):
    rank, size = dist.get_rank(), dist.get_world_size()
    chunk = -(-tensor.numel() // size) * tensor.element_size()
    peers = [(rank + 1) % size] * (size > 1)
    _said.update(sent_bytes=2 * (size - 1) * chunk, send_peers=peers, receive_peers=[(rank - 1) % size] * (size > 1))
    _said.update(collectives=[], collective_dtypes=[], collective_bytes=[], collective_groups=[])


def _junk(tensor):
    # Bytes for the kernel's count of the world's traffic, by messages: torch's all-reduce is counted by the kernel
    # too, where it counts calls (course/runtime/uprobes.py), and fails the ring.
    rank, size = dist.get_rank(), dist.get_world_size()
    for _ in range(2 * (size - 1)):
        sent = dist.isend(torch.zeros_like(tensor), (rank + 1) % size)
        dist.recv(torch.empty_like(tensor), (rank - 1) % size)
        sent.wait()
"""
FORGED_RING = (
    FORGED_LOG
    + """
import checks.test_ex05_ring as _check


def ring_all_reduce(tensor):
    rank, size = dist.get_rank(), dist.get_world_size()
    case = next(i for i in range(len(_check.CASES)) if torch.equal(tensor, _check.rank_tensor(i, rank)))
    tensor.copy_(sum(_check.rank_tensor(case, r) for r in range(size)))
    _as_a_ring_sends(tensor)
"""
)


# And one that sends the bytes a ring would, of junk, and forges the log of its collectives too: the kernel's
# count holds; what it lacks is the inputs, which the grade for credit draws as it runs and gives each rank
# its own only.
JUNK = """
_forged = ring_all_reduce


def ring_all_reduce(tensor):
    _forged(tensor)
    _junk(tensor)
"""


def _as_this_user():
    """The grader's settings as this process's user, sandboxed (a reason to skip where none can be)."""
    who = _who("root" if os.geteuid() == 0 else "a normal user")
    if isinstance(who, str):
        pytest.skip(who)
    return who


def test_a_forged_ring_with_its_bytes_gains_nothing_for_credit(tmp_path, monkeypatch):
    os.chmod(tmp_path, 0o755)
    monkeypatch.setenv("COURSE_FOR_CREDIT", "1")
    who = _as_this_user()
    _, path, _ = _grade_in_repository(tmp_path, who, {"dist.py": FORGED_RING + JUNK}, ex=5)
    found = results(path)
    assert found["score"] == 0 and {t["status"] for t in found["tests"]} == {"failed"}, found
    assert all("StopIteration" in t["output"] for t in found["tests"]), found  # no input of the checks' seeds


def test_a_forged_ring_with_its_bytes_passes_where_its_inputs_are_known(tmp_path):
    """The control: sandboxed, not for credit (a student's own grade, feedback on their own machine), the inputs
    are the checks' seeded ones and the forgery earns every point."""
    os.chmod(tmp_path, 0o755)
    who = _as_this_user()
    _, path, _ = _grade_in_repository(tmp_path, who, {"dist.py": FORGED_RING + JUNK}, ex=5)
    assert results(path)["score"] == 20, results(path)


@pytest.mark.parametrize("attacked", ATTACKERS, indirect=True)
def test_a_ring_that_exchanges_nothing_gains_nothing(attacked):
    base, who = attacked
    done, path, _ = _grade_in_repository(base, who, {"dist.py": FORGED_RING}, ex=5)
    found = results(path)
    assert found["score"] == 0 and {t["status"] for t in found["tests"]} == {"failed"}, found
    for check in found["tests"]:
        assert "the world's network carried" in check["output"] and "as the kernel counted them" in check["output"]


def test_a_ring_that_exchanges_nothing_passes_without_a_sandbox(tmp_path):
    """The control: with COURSE_SANDBOX=off no network is the world's own, and the forged log passes every check."""
    os.chmod(tmp_path, 0o755)
    _, path, _ = _grade_in_repository(tmp_path, (sys.executable, None, "off", ""), {"dist.py": FORGED_RING}, ex=5)
    assert results(path)["score"] == 20, results(path)


# Issue 47: the grader's memory, forked. A world's processes are forked from the grader; one forked while the
# judge held every rank's inputs holds them all too. This ring searches its process's objects for the list of
# every rank's tensors and sums them; with a ring's bytes of junk and its log forged, it earned everything
# where a check's call started its world. Each rank's inputs are made once its world runs (checks/helpers.py's
# Given), so it finds none.
FOUND_IN_MEMORY = (
    FORGED_LOG
    + """
import gc as _gc


def ring_all_reduce(tensor):
    rank, size = dist.get_rank(), dist.get_world_size()
    _as_a_ring_sends(tensor)
    _junk(tensor)
    for found in _gc.get_objects():
        if isinstance(found, list) and len(found) == size and all(isinstance(o, list) for o in found):
            mine = found[rank]
            for i, t in enumerate(mine):
                same = isinstance(t, torch.Tensor) and t.dtype == tensor.dtype and t.shape == tensor.shape
                if same and torch.equal(t, tensor) and all(len(other) == len(mine) for other in found):
                    tensor.copy_(sum(other[i] for other in found))
                    return
"""
)


def _graded_ring(base, cheats, leak=False):
    """Exercise 5's score of the stubs with cheats appended to dist.py; with leak, in a grader whose judge makes
    every rank's inputs before the world that receives them starts, as it once did."""
    grader, submission = _copy_grader(base, {"dist.py": cheats})
    if leak:
        check = grader / "checks" / "test_ex05_ring.py"
        assert "per_rank=given)" in check.read_text()
        check.write_text(check.read_text().replace("per_rank=given)", "per_rank=given())"))
    environ = dict(os.environ, COURSE_IMPL=str(submission))
    warm.run(["-m", "course", "grade", "--ex", "5"], cwd=grader, env=environ)
    return results(grader / "results.json")


def test_a_ring_that_finds_the_other_ranks_inputs_in_its_memory_gains_nothing(tmp_path):
    assert _graded_ring(tmp_path / "cheat", FOUND_IN_MEMORY)["score"] == 0
    # The control: where the world is forked after every rank's inputs were made, the search pays.
    assert _graded_ring(tmp_path / "leaked", FOUND_IN_MEMORY, leak=True)["score"] == 20


# Issue 47: a cost.py with no formula, whose every answer is looked up in the tables of exercise 12's checks (a
# student's copy holds them, answers and all). Where the grade counts, each check also runs cases drawn as it
# grades, answered by the reference solutions in a world no submission runs in.
LOOKED_UP = """
import checks.test_ex12_cost as _judge


def fit_alpha_beta(sizes, seconds):
    return _judge.ALPHA, _judge.BETA


def ring_allreduce_seconds(n, world_size, alpha, beta):
    return _judge.RINGS.get((n, world_size), 0.0)


def exposed_seconds(ready, sizes, backward_end, world_size, alpha, beta):
    return next((seconds for (at, _, _), seconds in _judge.SCHEDULES if at == ready), 0.0)  # all overlapped


def speedup(t_comp, t_sync, world_size):
    return _judge.SPEEDUPS.get((t_sync, world_size), 1.0)


def _same(one, other):
    return one is other or (type(one) is type(other) is _judge.Power and vars(one) == vars(other))


def largest_world(t_comp, t_sync_of, most=None):
    found = (e for (t, sync, m), e, _ in _judge.LARGEST if (t, m) == (t_comp, most) and _same(sync, t_sync_of))
    return next(found, most or 1024)  # where every R gains: the answer of a T_sync that stays small
"""


# And exercise 8's shard_sizes, looked up in its check's table of sizes.
LOOKED_UP_SIZES = """
import checks.test_ex08_data as _judge


def shard_sizes(n, fractions):
    return next((sizes for m, f, sizes in _judge.SIZES if (m, f) == (n, list(fractions))), [n] + [0] * (len(fractions) - 1))
"""
# exercise: (its file, the cheat, the points it earns in a student's own grade, the checks that name the drawn case)
LOOKED_UP_IN = {12: ("cost.py", LOOKED_UP, 20, 4), 8: ("data.py", LOOKED_UP_SIZES, 3, 1)}


@pytest.mark.parametrize("ex", sorted(LOOKED_UP_IN))
@pytest.mark.parametrize("for_credit", [True, False], ids=["for credit", "the control, a student's own grade"])
def test_answers_looked_up_in_the_checks_tables_gain_nothing_for_credit(tmp_path, for_credit, ex):
    name, cheat, control, named = LOOKED_UP_IN[ex]
    grader, submission = _instructors_repository(tmp_path, {name: cheat})
    environ = dict(os.environ, COURSE_IMPL=str(submission), COURSE_FOR_CREDIT="1" if for_credit else "")
    warm.run(["-m", "course", "grade", "--ex", str(ex)], cwd=grader, env=environ)
    found = results(grader / "results.json")
    assert found["score"] == (0 if for_credit else control), found  # the untouched stubs score 0
    if for_credit:
        drawn = [t for t in found["tests"] if "on a case drawn as the grade ran" in t["output"]]
        assert len(drawn) == named, found  # exercise 12's fit check names the line it was given instead


# And exercise 15's reference pp.py, its schedules and cuts looked up in the check's tables of textbook orders and
# cuts; the submission it is built on: the same pp.py with those three functions not written.
LOOKED_UP_SCHEDULES = """
import checks.test_ex15_pp as _judge


def _looked_up(schedule, m, p, s):
    try:
        return _judge.textbook(schedule, p, m, s)
    except KeyError:  # a case the tables lack: a valid schedule, if not the textbook's
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def gpipe(m, p, s):
    return _looked_up("gpipe", m, p, s)


def one_f_one_b(m, p, s):
    return _looked_up("1f1b", m, p, s)


def stage_layers(n_layers, world_size):
    if (n_layers, world_size) not in _judge.CUTS:
        return [range(0, n_layers)] + [range(n_layers, n_layers)] * (world_size - 1)
    return [range(layers[0], layers[-1] + 1) for layers in _judge.layers_by_rule(n_layers, world_size)]
"""
SCHEDULES_NOT_WRITTEN = """
def gpipe(m, p, s):
    raise NotImplementedError


def one_f_one_b(m, p, s):
    raise NotImplementedError


def stage_layers(n_layers, world_size):
    raise NotImplementedError
"""


def _graded_pp(base, functions, for_credit):
    """Exercise 15's grade of the reference pp.py with functions appended, and its checks by name."""
    grader, submission = _instructors_repository(base, {})
    (submission / "pp.py").write_text((pathlib.Path(SOLUTIONS) / "pp.py").read_text() + "\n" + functions)
    environ = dict(os.environ, COURSE_IMPL=str(submission), COURSE_FOR_CREDIT="1" if for_credit else "")
    warm.run(["-m", "course", "grade", "--ex", "15"], cwd=grader, env=environ)
    found = results(grader / "results.json")
    return found["score"], {t["name"].split(": ")[-1]: t for t in found["tests"]}


def test_schedules_looked_up_in_the_checks_tables_gain_nothing_for_credit(tmp_path):
    score, checks = _graded_pp(tmp_path / "cheat", LOOKED_UP_SCHEDULES, for_credit=True)
    honest, _ = _graded_pp(tmp_path / "honest", SCHEDULES_NOT_WRITTEN, for_credit=True)
    assert score <= honest < 30, (score, honest)
    for name in ("test_stage_layers", "test_order[gpipe]", "test_order[1f1b]", "test_training"):
        assert "on a case drawn as the grade ran" in checks[name]["output"], checks[name]
    # The control: in a student's own grade the tables answer every case the checks run.
    assert _graded_pp(tmp_path / "control", LOOKED_UP_SCHEDULES, for_credit=False)[0] == 30


# Issue 47: tensor parallelism whose communication log of each module says what the check expects, and whose
# Copy and AllReduce pass tensors through, each way: it exchanges nothing. Each rank given only its own block
# of the layers where the kernel counts, the block it computes is not one process's.
FORGED_TP_LOG = """
import sys as _sys

import checks.comm_log as _log
import checks.test_ex14_tp as _check

_FIRST = {}
for _name, _kind in _log.KINDS.items():
    _FIRST.setdefault(_kind, _name)
_WAYS = [(what, way) for what in ("ColumnParallelLinear", "RowParallelLinear", "ParallelMLP") for way in ("forward", "backward")]
_summary = _log.CommLog.summary
_logs = [0]


def _forged(self):
    found, frame = _summary(self), _sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "collectives_in_world":
        frame = frame.f_back
    if frame is None:
        return found
    if not hasattr(self, "_forged_at"):
        self._forged_at, _logs[0] = _logs[0] % len(_WAYS), _logs[0] + 1
    what, way = _WAYS[self._forged_at]
    kinds = _check.expected_collectives(frame.f_locals["sequence_parallel"])[what][way]
    return {**found, "collectives": [_FIRST[kind] for kind in kinds]}


_log.CommLog.summary = _forged
"""
SILENT_TP_LAYERS = """
class _Through(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


Copy = AllReduce = _Through
"""
SILENT_TP = FORGED_TP_LOG + SILENT_TP_LAYERS


def test_tensor_parallelism_that_exchanges_nothing_gains_nothing(tmp_path):
    """Its forged log passes the count of collectives; each rank given only its own block of the layers, the
    block it computes is not one process's."""
    os.chmod(tmp_path, 0o755)
    who = _as_this_user()
    _, path, _ = _grade_in_repository(
        tmp_path, who, {"tp.py": SILENT_TP}, ex=14, solved=SOLUTIONS, checks=("-k", "test_collectives")
    )
    found = {t["name"].split(": ")[-1]: t for t in results(path)["tests"]}
    assert found["test_collectives[sequence]"]["status"] == "passed", found  # the reference's, untouched
    silent = found["test_collectives[tensor]"]
    assert silent["status"] == "failed" and "each rank given only its own block" in silent["output"], silent


# Issue 47: layers that exchange nothing, and layers that exchange what they must but not over the world's
# network. FSDP whose units keep the whole model on every rank, and a mesh whose layers keep the whole block
# (each is given it, by the exercise's design), compute from what they were given; tensor parallelism whose
# functions pass tensors through computes partial sums. Each rank is given only its own shard or block, the rest
# other numbers: none computes one process's output.
SILENT_FSDP = """
def shard_layers(container, reshard_after_forward=True, param_dtype=None):
    pass
"""
SILENT_MESH = """
class MeshMLP(nn.Module):
    def __init__(self, layers, mesh):
        super().__init__()
        self.mesh, self.layers = mesh, nn.ModuleList(layers)

    def forward(self, x):
        return self.layers[1](torch.tanh(self.layers[0](x)))
"""
# The reference's own code, its collectives made through files in the world's own folder (every rank of a world
# writes there; one broadcast of 8 bytes names them): it computes one process's output, and the world's network
# carries almost nothing. The name `dist` of the student's module is rebound, torch's is not.
THROUGH_FILES = """
import os as _os
import tempfile as _tempfile
import time as _time
import types as _types

_torch_dist = dist
_made = {"name": None}


def _everyones(tensor, group=None):
    ranks = _torch_dist.get_process_group_ranks(group) if group is not None else list(range(_torch_dist.get_world_size()))
    if _made["name"] is None:
        token = torch.randint(0, 2**62, (1,))
        _torch_dist.broadcast(token, 0)
        _made["name"] = _os.path.join(_tempfile.gettempdir(), f"sums-{int(token)}")
    key = "-".join(map(str, ranks))
    _made[key] = _made.get(key, 0) + 1
    name, rank = f"{_made['name']}-{key}-{_made[key]}", _torch_dist.get_rank()
    torch.save(tensor.detach().clone(), f"{name}.{rank}.part")
    _os.replace(f"{name}.{rank}.part", f"{name}.{rank}")
    paths = [f"{name}.{r}" for r in ranks]
    while not all(_os.path.exists(p) for p in paths):
        _time.sleep(0.001)
    return [torch.load(p) for p in paths], ranks.index(rank)


def _all_reduce(tensor, op=None, group=None, async_op=False):
    tensor.copy_(sum(_everyones(tensor, group)[0]))


def _all_gather_into_tensor(output, tensor, group=None, async_op=False):
    output.copy_(torch.cat(_everyones(tensor, group)[0]))


def _reduce_scatter_tensor(output, tensor, op=None, group=None, async_op=False):
    everyone, index = _everyones(tensor, group)
    output.copy_(sum(everyone).chunk(len(everyone))[index])


dist = _types.SimpleNamespace(**vars(_torch_dist))
dist.all_reduce, dist.all_gather_into_tensor = _all_reduce, _all_gather_into_tensor
dist.reduce_scatter_tensor = _reduce_scatter_tensor
"""
# exercise: (its file, the silent code, its check module, the kernel check's arguments after the folder, what the
# values say of the silent code)
SILENT = {
    13: ("fsdp.py", SILENT_FSDP, "checks.test_ex13_fsdp", (2,), "what it computes alone"),
    14: ("tp.py", SILENT_TP_LAYERS, "checks.test_ex14_tp", (False, 2), "where one process's is"),
    16: ("nd.py", SILENT_MESH, "checks.test_ex16_nd", (2, 2), "what it computes alone"),
}


@pytest.mark.parametrize("ex", sorted(SILENT))
def test_layers_that_exchange_nothing_or_not_over_the_network_fail_their_kernel_check(tmp_path, ex):
    """The silent layers fail on their values; those that exchange through files compute the right values (the
    values are judged first) and fail on the kernel's count of the world's network."""
    import importlib

    from checks.helpers import world

    name, code, module, args, silent_said = SILENT[ex]
    check = importlib.import_module(module).check_kernel_count
    if world(os.getpid, 2, expect=int, observe=True).loopback_bytes is None:
        pytest.skip("no sandbox level with a network of its own here: the kernel counts nothing per world")
    _, silent = _copy_grader(tmp_path / "silent", {name: code}, SOLUTIONS)
    _, through = _copy_grader(tmp_path / "through", {name: THROUGH_FILES}, SOLUTIONS)
    check(SOLUTIONS, *args)
    with pytest.raises(AssertionError, match=silent_said):
        check(str(silent), *args)
    with pytest.raises(AssertionError, match="as the kernel counted them"):
        check(str(through), *args)


# Issue 47: an exercise done by the part of torch it teaches to write. Each computes what the exercise must, so
# nothing but the kernel's count of torch's entries tells (tests/mutants: each passes every check without it).
TORCH_OWN_MYDP = """
class MyDP(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.module = nn.parallel.DistributedDataParallel(model)

    @staticmethod
    def _average_across_ranks(grad):
        mean = grad / dist.get_world_size()
        dist.all_reduce(mean)
        return mean

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
"""
TORCH_OWN_OVERLAPPED = """
class OverlappedDP(nn.Module):
    def __init__(self, model, bucket_cap_mb=25):
        super().__init__()
        self.module = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        self.require_backward_grad_sync = True

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
"""
TORCH_OWN_NO_SYNC = (
    TORCH_OWN_OVERLAPPED
    + """
    def no_sync(self):
        return self.module.no_sync()
"""
)
TORCH_OWN_RING = """
def ring_all_reduce(tensor):
    funcol = __import__("torch.distributed._functional_collectives", fromlist=["all_reduce"])
    tensor.copy_(funcol.wait_tensor(funcol.all_reduce(tensor, "sum", dist.group.WORLD)))
"""
TORCH_OWN_HOOK = """
def bf16_average_hook(group, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, group, bucket)
"""
TORCH_OWN_MESSAGES = """
def communicate(sends, receives):
    from torch.distributed.pipelining.schedules import _batch_p2p

    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in receives]
    for request in _batch_p2p(ops):
        request.wait()
"""
TORCH_OWN_TP_SUM = """
class AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Partial, Replicate

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        partial = DTensor.from_local(x.contiguous(), mesh, [Partial()], run_check=False)
        return partial.redistribute(placements=[Replicate()]).to_local().clone()

    @staticmethod
    def backward(ctx, grad):
        return grad
"""
TORCH_OWN_AVERAGE = """
def average_parameters(model):
    from torch.distributed.algorithms.model_averaging.utils import average_parameters as averaged

    averaged(model.parameters(), dist.group.WORLD)
"""
# exercise: (its file, the code, the checks that run it, what the sentence names)
TORCH_OWN = {
    4: ("mydp.py", TORCH_OWN_MYDP, "test_", "torch's DistributedDataParallel"),
    5: ("dist.py", TORCH_OWN_RING, "test_ring", "a collective of torch's"),
    6: ("mydp.py", TORCH_OWN_OVERLAPPED, "test_overlapped_steps", "torch's DistributedDataParallel"),
    7: ("mydp.py", TORCH_OWN_NO_SYNC, "test_no_sync_accumulates", "torch's DistributedDataParallel"),
    9: ("sync.py", TORCH_OWN_AVERAGE, "test_average_parameters", "torch's model averaging"),
    11: ("zero.py", TORCH_OWN_HOOK, "test_hook", "torch's DDP communication hooks"),
    14: ("tp.py", TORCH_OWN_TP_SUM, "test_forward[tensor", "torch's DTensor"),
    15: ("pp.py", TORCH_OWN_MESSAGES, "test_messages", "torch's pipelining"),
}


@pytest.mark.parametrize("ex", sorted(TORCH_OWN))
def test_an_exercise_done_by_torchs_own_fails_the_checks_it_would_pass(tmp_path, ex):
    if not uprobes.available(by_number(ex).forbids):
        pytest.skip("the kernel counts no calls for this process here (no root, no uprobes)")
    os.chmod(tmp_path, 0o755)
    name, code, affected, used = TORCH_OWN[ex]
    _, path, _ = _grade_in_repository(tmp_path, _as_this_user(), {name: code}, ex=ex, solved=SOLUTIONS, credit=True)
    ran = [t for t in results(path)["tests"] if t["name"].split(": ")[-1].startswith(affected)]
    assert ran and all(t["status"] == "failed" and f"used {used}" in t["output"] for t in ran), ran
    assert all("the kernel counted" in t["output"] for t in ran), "for credit, the kernel's count decides"


# Issue 47: a probe that held the whole batch on every rank. The checks of exercises 3, 4 and 6 once made each
# step's batch on every rank and handed the wrapper its own rows: a MyDP that averages nothing, whose forward
# finds the whole batch in its caller's frame and returns the loss on it, had the average gradient without a
# message. Each rank is given its own rows only now.
BROADCAST_ONLY_MYDP = """
class MyDP(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.module = model
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)

    def forward(self, x, y):
        return self.module(*self._batch(x, y))

    def _batch(self, x, y):
        return x, y
"""
WHOLE_BATCH_FROM_THE_FRAMES = """
import sys as _sys


def _whole(self, x, y):
    frame = _sys._getframe(2)
    while frame is not None:
        found = [v for v in frame.f_locals.values() if isinstance(v, torch.Tensor) and v.dim() == 2]
        found = [v for v in found if v.shape[1] == x.shape[1] and v.shape[0] > x.shape[0]]
        labels = [v for v in frame.f_locals.values() if isinstance(v, torch.Tensor) and v.dim() == 1]
        labels = [v for v in labels if found and v.shape[0] == found[0].shape[0]]
        if found and labels:
            return found[0], labels[0]
        frame = frame.f_back
    return x, y


MyDP._batch = _whole
"""


def _graded_mydp(base, cheats, leak=False):
    """Exercise 4's score of the stubs with cheats appended to mydp.py; with leak, in a grader whose probe makes
    the whole batch on every rank, as it once did."""
    grader, submission = _copy_grader(base, {"mydp.py": cheats})
    if leak:
        helpers = grader / "checks" / "helpers.py"
        line = "        _, loss = wrapped(x, y)\n"
        planted = "        whole_x, whole_y = global_batch(CONFIG, step, dist.get_world_size())\n" + line
        assert line in helpers.read_text()
        helpers.write_text(helpers.read_text().replace(line, planted))
    environ = dict(os.environ, COURSE_IMPL=str(submission))
    warm.run(["-m", "course", "grade", "--ex", "4"], cwd=grader, env=environ)
    return results(grader / "results.json")


def test_a_mydp_that_reads_the_whole_batch_gains_nothing(tmp_path):
    honest = _graded_mydp(tmp_path / "honest", BROADCAST_ONLY_MYDP)
    cheat = _graded_mydp(tmp_path / "cheat", BROADCAST_ONLY_MYDP + WHOLE_BATCH_FROM_THE_FRAMES)
    assert cheat["score"] <= honest["score"] < 30, (honest["score"], cheat["score"])
    # The control: where a probe holds the whole batch, the same MyDP earns the steps checks it never earned.
    leaked = _graded_mydp(tmp_path / "leaked", BROADCAST_ONLY_MYDP + WHOLE_BATCH_FROM_THE_FRAMES, leak=True)
    assert leaked["score"] > honest["score"], (honest["score"], leaked["score"])


# Issue 47: a world without limits. Its folder took 1 GiB of the grader's disk, a rank could take the machine's
# memory, a notebook's worker output (a file) grew to 108 MB; and the grader's own files for the world (the
# public copy of the course, each rank's stack file and board) were in that folder, the ranks' to write. Now a
# world's own folder is a tmpfs of limited size, no rank writes a file past a limit or allocates past one, and
# the grader's files are out of reach. Small limits here, so that the payload is quick.
SMALL_LIMITS = {"COURSE_LIMIT_DISK": "16", "COURSE_LIMIT_FILE": "8", "COURSE_LIMIT_MEMORY": "1024"}
TAKE_WITHOUT_LIMIT = """
import os as _os, sys as _sys, tempfile as _tempfile, uuid as _uuid

def _tried(what, do):
    try:
        do()
        said = "done"
    except (OSError, RuntimeError, MemoryError) as error:
        said = f"refused ({type(error).__name__})"
    print(f"CHEAT {what}: {said}", file=_sys.stderr, flush=True)

def _fill(files, mib):
    paths = [_os.path.join(_tempfile.gettempdir(), f"fill-{_uuid.uuid4().hex}") for k in range(files)]
    try:
        for path in paths:
            with open(path, "wb") as f:
                f.write(bytes(mib << 20))
    finally:
        for path in paths:
            if _os.path.exists(path):
                _os.unlink(path)

def _append(path):
    with open(path, "a") as f:
        f.write("# a rank was here")

_tried("write a file past the limit", lambda: _fill(1, 9))
import checks.helpers as _public
_tried("write the public copy of the checks", lambda: _append(_public.__file__))
_own, _graders = _os.path.basename(_tempfile.gettempdir()), _os.path.dirname(_tempfile.gettempdir())
for _name in ("rank0.stack", "rank0.waits", "public/checks/helpers.py") if _own == "own" else ():
    # the grader's folder for the world, around the world's own
    _tried(f"write the grader's {_name}", lambda: _append(_os.path.join(_graders, _name)))

def par_matmul_by_row(A, B):
    _fill(6, 4)
    return None

def par_matmul_by_reduction(A, B):
    torch.empty(2 << 30, dtype=torch.uint8)
"""


@pytest.mark.parametrize("attacked", ATTACKERS, indirect=True)
def test_a_world_takes_no_more_than_its_limits(attacked, monkeypatch):
    base, who = attacked
    for name, value in SMALL_LIMITS.items():
        monkeypatch.setenv(name, value)
    done, path, said = _grade_in_repository(base, who, {"dist.py": TAKE_WITHOUT_LIMIT})
    tried = {line.partition(": ")[0] for line in said.splitlines()}
    assert "done" not in said and len(tried) == 5, said
    found = assert_no_points(done, path)
    feedback = {t["name"]: t["output"] for t in found["tests"]}
    disk = "holds at most 16 MiB of files where grades are made (COURSE_LIMIT_DISK)"
    memory = "may allocate at most 1024 MiB of memory where grades are made (COURSE_LIMIT_MEMORY)"
    for name, text in feedback.items():
        if "by_row" in name:
            assert "No space left on device" in text and disk in text and "dist.py" in text, text
        if "by_reduction" in name:
            assert memory in text and "dist.py" in text, text


def test_a_world_takes_what_it_wants_without_a_sandbox(tmp_path, monkeypatch):
    """The control: with COURSE_SANDBOX=off each limit is the machine's: the payload's writes and its
    allocation succeed, and nothing says a limit."""
    os.chmod(tmp_path, 0o755)
    for name, value in SMALL_LIMITS.items():
        monkeypatch.setenv(name, value)
    cheat = {"dist.py": TAKE_WITHOUT_LIMIT}
    done, _, said = _grade_in_repository(tmp_path, (sys.executable, None, "off", ""), cheat)
    assert "write a file past the limit: done" in said, said
    assert "COURSE_LIMIT" not in done.stdout, done.stdout


# Issue 47: what a notebook's workers print went, unbounded, into its feedback (108 MB made a 110 MB notebook
# and took autograde's process to 1.1 GB). Rank 0 of each world prints 24 MiB once (once per machine without
# a sandbox): past the 16 MiB a rank's file may reach (COURSE_LIMIT_FILE), its output.txt included.
PRINTS_WITHOUT_END = """
import os as _os, sys as _sys, tempfile as _tempfile
_mark = _os.path.join(_tempfile.gettempdir(), "printed" + _os.path.dirname(_os.path.abspath(__file__)).replace("/", "-"))
if _os.environ.get("RANK") == "0" and not _os.path.exists(_mark):
    open(_mark, "w").close()
    try:
        for _ in range(24):
            print("x" * ((1 << 20) - 1), flush=True)
    except OSError:
        pass
"""


def _autograde_class(base, who, listener):
    """`make autograde` of exercise 2, as who says, in the instructors' repository (a grader's copy
    with solutions/), on a class: alice, correct, and one student per cheat; the grading folder."""
    python, user, mode, packages = who
    base = pathlib.Path(base)
    grader, _ = _copy_grader(base, {})
    shutil.copytree(SOLUTIONS, grader / "solutions", ignore=shutil.ignore_patterns("__pycache__"))
    cheats = {**VIEW_CHEATS, "reaches_a_listener": _reaching(listener), "prints_without_end": PRINTS_WITHOUT_END}
    for student, cheat in [("alice", None), *cheats.items()]:
        folder = base / "class" / student
        folder.mkdir(parents=True)
        for name in STUDENT_FILES:
            shutil.copy(os.path.join(SOLUTIONS if cheat is None else ROOT, name), folder)
        if cheat is not None:
            with open(folder / "dist.py", "a") as f:
                f.write("\n" + cheat)
    _as_user(base, who)
    env = {k: v for k, v in os.environ.items() if k != "COURSE_IMPL"} | {"COURSE_SANDBOX": mode, "HOME": str(base)}
    if packages:
        env["PYTHONPATH"] = packages
    command = ["-m", "course.instructors.autograde", str(base / "class"), "--out", str(base / "grading"), "--ex", "2"]
    done = warm.run(command, cwd=grader, env=env, python=python, user=user, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return base / "grading"


def _graded(out, student):
    found = results(out / "feedback" / student / "results.json")
    with open(out / "feedback" / student / "output.txt") as f:
        said = "\n".join(line for line in f.read().splitlines() if line.startswith("CHEAT")) or "(nothing)"
    return found, said


@pytest.mark.parametrize("mode", ["uid", "namespaces"])
def test_a_class_whose_cheats_read_or_reach_others_is_graded_as_if_they_did_not(tmp_path, mode):
    """Autograde, at each level: each cheat scores 0 with its reason, and alice, the classmate they
    go after, full marks with a correct submission's feedback; no grade is advisory. (The grader
    runs as this process's user and Python: Jupyter's exporters do not run under another Python
    with this environment's packages, which the attackers above need for a normal user.)"""
    if mode == "uid" and os.geteuid() != 0:
        pytest.skip("the uid level needs root")
    os.chmod(tmp_path, 0o755)
    base, who = tmp_path, (sys.executable, None, mode, "")
    listener = _Listener()
    try:
        out = _autograde_class(base, who, listener)
        assert not listener.reached(), "a worker reached a listener of the machine's network"
    finally:
        listener.close()
    alice, _ = _graded(out, "alice")
    assert alice["score"] == 25 and {(t["status"], t["output"]) for t in alice["tests"]} == {("passed", "")}, alice
    for student in [*VIEW_CHEATS, "reaches_a_listener"]:
        found, said = _graded(out, student)
        assert found["score"] == 0, (student, said)
        assert all("is not written yet" in t["output"] for t in found["tests"]), found
        assert "refused" in said and "done" not in said, f"{student}: what the payload could do:\n{said}"
        assert "extra_data" not in found, found
    found, _ = _graded(out, "prints_without_end")
    assert found["score"] == 0 and all("is not written yet" in t["output"] for t in found["tests"]), found
    assert os.path.getsize(out / "feedback" / "prints_without_end" / "output.txt") <= 16 << 20
    with open(out / "report.json") as f:
        assert not json.load(f)["advisory"]


def test_a_class_whose_cheats_read_or_reach_others_pays_without_a_sandbox(tmp_path):
    """The control: with COURSE_SANDBOX=off each cheat takes what it went for, and every grade and
    the class report say they are advisory, and why."""
    os.chmod(tmp_path, 0o755)
    listener = _Listener()
    try:
        out = _autograde_class(tmp_path, (sys.executable, None, "off", ""), listener)
        assert listener.reached()
    finally:
        listener.close()
    for student in VIEW_CHEATS:
        found, said = _graded(out, student)
        assert found["score"] == 25, (student, said)
        assert found["extra_data"]["advisory"] == "submission code ran without a sandbox (COURSE_SANDBOX=off)", found
        assert "This grade is advisory: submission code ran without a sandbox" in found["output"], found
    assert "done" in _graded(out, "reaches_a_listener")[1]
    assert os.path.getsize(out / "feedback" / "prints_without_end" / "output.txt") >= 24 << 20
    with open(out / "report.json") as f:
        assert "COURSE_SANDBOX=off" in json.load(f)["advisory"]
    assert "These grades are advisory" in (out / "report.html").read_text()


def test_a_level_without_a_view_makes_an_advisory_grade(tmp_path):
    """Where a level is had but its workers cannot be given a view of their own submission (each
    probe says so here), the grade is made and said to be advisory, with the reason: in its last
    line and in results.json's extra_data."""
    probes = (
        "from course.runtime import sandbox\n\n"
        "_probes = dict(sandbox._PROBES)\n"
        "sandbox._PROBES.update({n: (lambda p: lambda r, s: (p(r, None)[0], 'no view here'))(p) for n, p in _probes.items()})\n"
    )
    (tmp_path / "no_view.py").write_text(probes)
    environ = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    args = ["--ex", "2", "--results", str(tmp_path / "results.json"), "--", "-p", "no_view", "-k", "test_by_row[1]"]
    done = warm.grade(*args, impl=SOLUTIONS, cwd=ROOT, env=environ)  # a folder the world's uid can enter
    assert done.returncode == 0, done.stdout + done.stderr
    reason = "submission code could read files other than its own (no view here)"
    assert f"{reason}: this grade is advisory." in done.stdout, done.stdout
    found = results(tmp_path / "results.json")
    assert [t["name"] for t in found["tests"]] == ["Exercise 2: test_by_row[1]"], found["tests"]
    assert found["score"] == found["tests"][0]["max_score"] > 0, found["tests"][0]["output"]
    assert found["extra_data"] == {"advisory": reason}, found
