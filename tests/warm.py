"""`python ARGS` for tests that start many interpreters: forked from one that imported torch once.

A fresh interpreter spends about 1.5 s of CPU importing torch and pytest before it does what a
test asks; the tests that grade a submission or run a script start dozens. run() forks each from a
server process (one per test process) that imported torch, torch._dynamo and pytest, and nothing
of this repository. The fork then does what `python -m MODULE ARGS` or `python SCRIPT ARGS`
does: its own argv, working directory, environment, sys.path and standard streams, atexit
handlers at the end, the exit status of SystemExit or 1 with a traceback.

What differs from a fresh interpreter: those modules are already imported, so what torch reads
from the environment at import comes from the suite's (tests/conftest.py). Tests about how a
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

_server = None
_unread = b""


def _start():
    global _server, _unread
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            cwd=tempfile.gettempdir(),
        )
        _unread = b""
    return _server


def server_pid():
    """The server's pid, while it runs: it lives as long as the test process."""
    return _server.pid if _server is not None and _server.poll() is None else None


def _answer(timeout):
    """The server's next line, or None if none came within timeout seconds."""
    global _unread
    while b"\n" not in _unread:
        ready, _, _ = select.select([_server.stdout], [], [], timeout)
        chunk = os.read(_server.stdout.fileno(), 4096) if ready else b""
        if not chunk:
            return None
        _unread += chunk
    line, _unread = _unread.split(b"\n", 1)
    return line.decode()


def run(args, cwd, env=None, timeout=120):
    """subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout), forked from the warm server; args start with "-m MODULE" or a script."""
    server = _start()
    environ = dict(os.environ if env is None else env)
    command = [sys.executable, *args]
    with tempfile.TemporaryDirectory() as streams:
        out, err = os.path.join(streams, "out"), os.path.join(streams, "err")
        request = {"args": list(args), "cwd": os.fspath(cwd), "env": environ, "out": out, "err": err}
        server.stdin.write((repr(request) + "\n").encode())
        pid = int(_answer(60))
        done = _answer(timeout)
        if done is None:
            _kill(pid)
            _answer(60)
        with open(out) as f_out, open(err) as f_err:
            stdout, stderr = f_out.read(), f_err.read()
    if done is None:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, int(done.split()[1]), stdout, stderr)


def _kill(pid):
    """The command and what it started (its workers die with it: course/workers.py)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
