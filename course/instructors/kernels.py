"""Notebook kernels forked from a process that has imported torch already, for autograding.

A new Jupyter kernel imports ipykernel and torch before it runs a cell: about 2.5 s of CPU here.
Grading N students pays that N times (one kernel per student). This provisioner instead forks each kernel
from one server process (multiprocessing's forkserver) that imported them once: a kernel is then
ready in a fraction of a second. Registered as the Jupyter kernel provisioner "course-forked"
(pyproject.toml); course/instructors/autograde.py selects it with JUPYTER_DEFAULT_PROVISIONER_NAME. Linux
only, like the rest of the instructors' tools.

Each kernel runs in its own session, as jupyter's own launcher does, so that interrupting or
killing its process group reaches the kernel and the workers it started, and nothing else. A
kernel exits when the server does (ipykernel's parent poller), and the server exits with the
process that started it.
"""

from __future__ import annotations

import multiprocessing as mp
import os

from jupyter_client.provisioning import LocalProvisioner

from course.runtime import env, sandbox

# A process's first optimizer or DDP imports torch._dynamo: 2 s of CPU, paid once here instead
# of in every kernel and every worker. (Each kernel imports course.grading.in_notebook itself: that sets
# up the kernel's sys.path.)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "ipykernel.kernelapp", "pytest", "course.launch"]
_server = None


def _forkserver():
    global _server
    if _server is None:
        _server = mp.get_context("forkserver")
        _server.set_forkserver_preload(PRELOAD)
    return _server


def start_server() -> None:
    """Start the kernels' server now, so that its imports run while autograding does its own set-up."""
    import multiprocessing.forkserver

    _forkserver()
    multiprocessing.forkserver.ensure_running()


def _kernel(argv: list, environ: dict, cwd: str) -> None:
    os.setsid()
    sandbox.protect()  # its memory and descriptors (the checks process's connection) are no one's to take
    if environ.get(env.KERNEL_OUTPUT):  # the student's output: their feedback, not the instructor's terminal
        output = os.open(environ[env.KERNEL_OUTPUT], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    from ipykernel.kernelapp import IPKernelApp

    # The forkserver is this kernel's parent: the kernel exits when it does.
    quiet = ["--IPKernelApp.log_level=ERROR"]  # not a warning per kernel about TCP on localhost
    IPKernelApp.launch_instance(argv=argv + quiet + [f"--IPKernelApp.parent_handle={os.getppid()}"])


class _Process:
    """The part of subprocess.Popen that jupyter's LocalProvisioner uses, for a forked kernel."""

    stdin = stdout = stderr = None

    def __init__(self, process: mp.Process):
        self.process, self.pid = process, process.pid

    def poll(self):
        return self.process.exitcode

    def wait(self, timeout=None):
        self.process.join(timeout)
        return self.process.exitcode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        self.process.kill()

    def terminate(self) -> None:
        self.process.terminate()


class ForkedKernelProvisioner(LocalProvisioner):
    """LocalProvisioner whose ipykernel kernels are forked from a warm server instead of exec'd."""

    async def launch_kernel(self, cmd: list, **kwargs):
        if "ipykernel_launcher" not in cmd:  # another language's kernel: start it as usual
            return await super().launch_kernel(cmd, **kwargs)
        argv = cmd[cmd.index("ipykernel_launcher") + 1 :]
        process = _forkserver().Process(
            target=_kernel,
            args=(argv, dict(kwargs.get("env") or os.environ), kwargs.get("cwd") or os.getcwd()),
            name="kernel",
        )
        process.start()
        self.process = _Process(process)
        self.pid = self.pgid = process.pid  # its own process group, once it has called setsid
        self.cwd = kwargs.get("cwd")
        return self.connection_info
