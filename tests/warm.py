"""`python ARGS` for tests that start many interpreters: forked from one that imported torch once.

A fresh interpreter spends about 1.5 s of CPU importing torch and pytest before it does what a
test asks; the tests that grade a submission or run a script start dozens. run() forks each from a
server process (one per test process) that imported torch, torch._dynamo and pytest, and nothing
of this repository. The fork then does what `python -m MODULE ARGS` or `python SCRIPT ARGS`
does: its own argv, working directory, environment, sys.path and standard streams, atexit
handlers at the end, the exit status of SystemExit or 1 with a traceback.

run(..., python=P) forks from a server of interpreter P instead (one server per interpreter), and
run(..., user=(uid, gid)) runs the command as that user (the server must run as root), and
run(..., name=NAME) gives it (and what it forks) that process name (Linux's comm).

What differs from a fresh interpreter: those modules are already imported, so what torch reads
from the environment at import comes from the suite's (checks/conftest.py). Tests about how a
process starts or stops (signals, Ctrl-C, a killed parent), the release test's `make grade`, and
the README's commands in a fresh clone, start real interpreters.
"""

import os
import select
import signal
import subprocess
import sys
import tempfile

# The server: reads one request per line (a repr of a dict), forks, answers "PID" then "PID STATUS".
_SERVER = r"""
import ast, atexit, os, runpy, sys, traceback
import torch, torch.distributed, torch._dynamo, pytest

base_path = list(sys.path[1:])


def child(request):
    if request["name"]:  # its process name (/proc/PID/comm), which the processes it forks keep
        import ctypes

        ctypes.CDLL(None).prctl(15, request["name"].encode(), 0, 0, 0)
    if request["user"] is not None:
        uid, gid = request["user"]
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["out"]), (2, request["err"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    args = request["args"]
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    code = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[:] = [os.getcwd(), *extra, *base_path]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[:] = [os.path.dirname(os.path.abspath(args[0])), *extra, *base_path]
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


for line in sys.stdin:
    request = ast.literal_eval(line)
    pid = os.fork()
    if pid == 0:
        sys.stdin = open(os.devnull)
        child(request)
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(pid, os.waitstatus_to_exitcode(status), flush=True)
"""


class _Server:
    def __init__(self, python, environ):
        self.process = subprocess.Popen(
            [python, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            cwd=tempfile.gettempdir(),
            env=environ,
        )
        self.unread = b""

    def answer(self, timeout):
        """The server's next line, or None if none came within timeout seconds."""
        while b"\n" not in self.unread:
            ready, _, _ = select.select([self.process.stdout], [], [], timeout)
            chunk = os.read(self.process.stdout.fileno(), 4096) if ready else b""
            if not chunk:
                return None
            self.unread += chunk
        line, self.unread = self.unread.split(b"\n", 1)
        return line.decode()


_servers = {}  # by interpreter


def _start(python, environ):
    server = _servers.get(python)
    if server is None or server.process.poll() is not None:
        server = _servers[python] = _Server(python, environ)
    return server


def server_pids():
    """The pids of this process's servers, one per interpreter (test_cheating's attackers run one of a Python
    every user can read), while they run: they live as long as the test process."""
    return [server.process.pid for server in _servers.values() if server.process.poll() is None]


def run(args, cwd, env=None, timeout=120, python=None, user=None, name="", started=None):
    """subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout), forked from the warm server of python (default sys.executable), as user
    (uid, gid) when given; args start with "-m MODULE" or a script. started(pid), where given, as
    soon as the command's process is forked (tests/own_time.py's Watch.follow)."""
    environ = dict(os.environ if env is None else env)
    python = python or sys.executable
    server = _start(python, environ)
    command = [python, *args]
    with tempfile.TemporaryDirectory() as streams:
        if user is not None:
            os.chown(streams, *user)
        out, err = os.path.join(streams, "out"), os.path.join(streams, "err")
        request = dict(args=list(args), cwd=os.fspath(cwd), env=environ, out=out, err=err, user=user, name=name)
        server.process.stdin.write((repr(request) + "\n").encode())
        pid = int(server.answer(60))
        if started is not None:
            started(pid)
        done = server.answer(timeout)
        if done is None:
            _kill(pid)
            server.answer(60)
        with open(out) as f_out, open(err) as f_err:
            stdout, stderr = f_out.read(), f_err.read()
    if done is None:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, int(done.split()[1]), stdout, stderr)


def grade(*args, impl, cwd, env=None, timeout=120, started=None):
    """`python -m course grade ARGS` on the code at impl (COURSE_IMPL), from the warm server, as run()
    runs it; env: variables to add to this process's."""
    environ = dict(os.environ, COURSE_IMPL=str(impl), **(env or {}))
    return run(["-m", "course", "grade", *args], cwd=cwd, env=environ, timeout=timeout, started=started)


def _kill(pid):
    """The command and what it started (its workers die with it: course/runtime/workers.py)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
