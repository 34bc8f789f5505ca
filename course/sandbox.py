"""Where graded code runs: worker processes that cannot see, signal, trace or write the grader's.

The checks run submission code only in the workers of grading worlds (tests/helpers.py calls
``run(..., sandbox=True)``, course/workers.py). Those workers are confined before the first line
of a submission runs, as far as the machine allows (``level()``):

- ``uid`` (Linux, the grader runs as root: Gradescope, a container). A world gets a user and group
  id of its own, from a range no account uses (COURSE_SANDBOX_UIDS, default 40000-49999), held by
  a lock file while the world lives. Its workers take it with no capability left (the bounding
  set emptied too), no new privileges and a cap on their processes. A process of another user
  cannot be traced, read or written by them (/proc/PID/mem, /proc/PID/fd, pidfd_getfd), nor
  signalled; root's files, folders and sockets are not theirs to write or connect to. The world's
  own folder (its store, stack files, HOME and TMPDIR) is the one folder made for them. When the
  world ends, every process of its uid dies at once: kill(-1) from a process of that uid, which no
  fork can outrun (the kernel signals under the lock that fork takes to add a process). This
  level needs a Python, a course and a submission that every user can read; where they are not
  (a Python under /root), root gets the next level.
- ``namespaces`` (Linux, where the kernel allows user namespaces: a normal user on a laptop or an
  instructor's machine, or root as above). A world gets a holder process that owns a user and a
  network namespace: its ranks join them, so they reach each other over loopback and nothing
  else (no port of the machine: a notebook kernel's, a server's; no abstract socket). Each rank
  then gets a mount and a pid namespace of its own: every mount read-only but its world's folder,
  no process but its own descendants, all killed by the kernel when it ends (it is process 1 of
  its namespace), and no capability left.
- ``none`` elsewhere (macOS, Windows, a kernel without user namespaces), or COURSE_SANDBOX=off.
  The grade is then advisory.

At both levels a worker may not create a unix-domain socket (a seccomp filter, x86-64 and arm64):
no connection to a socket of the user's or world-writable one (multiprocessing's servers, an SSH
agent, X11, systemd's user bus), in a folder or in the abstract namespace.

COURSE_SANDBOX: auto (the default), required (no grading without a sandbox: the Gradescope
autograder sets it), uid or namespaces (that level or none), off. Whatever the level, the grader's
own processes (the grading process and its copy, the notebook kernels and their checks processes)
call protect(): not dumpable, so that no process of the same user can read or write their memory
or take their descriptors.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import signal
import sys
import tempfile
from dataclasses import dataclass

LINUX = sys.platform.startswith("linux")

_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 4, 24, 36, 38
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_MS_REC, _MS_PRIVATE = 16384, 1 << 18
# A mount's flags that a user namespace may not clear (the kernel locks them): kept when remounting.
_LOCKED = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC, "noatime": 1024, "nodiratime": 2048}
_LOCKED |= {"relatime": 1 << 21, "strictatime": 1 << 24}
# Processes (threads count) one world's uid may have: a fork bomb stops there, not at the machine's limit.
_MOST_PROCESSES = 1024


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _call(name: str, *args) -> None:
    if getattr(_libc(), name)(*args) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{name}: {os.strerror(error)}")


def prctl(option: int, value: int) -> None:
    """Linux's prctl(option, value); nothing elsewhere."""
    if LINUX:
        _call("prctl", option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def die_with_parent() -> None:
    """This process is killed when the one that started it ends, however it ends (Linux only)."""
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def adopt_orphans() -> None:
    """Orphans of this process's descendants come to it rather than to init (Linux): to be stopped."""
    prctl(_PR_SET_CHILD_SUBREAPER, 1)


def protect() -> None:
    """Make this process of the grader's not dumpable: no process of the same user (a worker of a
    machine without a sandbox) can then read or write its memory, trace it, or take its descriptors."""
    prctl(_PR_SET_DUMPABLE, 0)


# ---- which sandbox this machine allows --------------------------------------------------------


@dataclass(frozen=True)
class Level:
    name: str  # "uid", "namespaces" or "none"
    reason: str  # what it means, or why there is none

    def line(self) -> str:
        """One line for the grade's output."""
        if self.name == "none":
            return f"Submission code ran without a sandbox ({self.reason}): this grade is advisory."
        return f"Submission code ran sandboxed: {self.reason}."


class NoSandbox(RuntimeError):
    """COURSE_SANDBOX asks for a sandbox that this machine does not allow."""


_WHAT = {
    "uid": "each world a user of its own, with no capabilities",
    "namespaces": "each world its own user and network namespace, each rank its own read-only mounts and pids",
}


@functools.cache
def level(readable: tuple = ()) -> Level:
    """The sandbox that grading worlds get on this machine (COURSE_SANDBOX), tried once per process.

    ``readable``: folders the workers must read (the course, the submission, torch), besides
    Python's own: the ``uid`` level needs its user to read them all.
    """
    mode = os.environ.get("COURSE_SANDBOX", "auto")
    if mode not in ("auto", "required", "off", "uid", "namespaces"):
        raise ValueError(f"COURSE_SANDBOX is {mode!r}: auto, required, uid, namespaces or off")
    if mode == "off":
        return Level("none", "COURSE_SANDBOX=off")
    if not LINUX:
        found, problems = None, [f"no sandbox on {sys.platform}"]
    else:
        tried = [name for name in ("uid", "namespaces") if mode in (name, "auto", "required")]
        if os.geteuid() != 0 and "uid" in tried:
            tried.remove("uid")
        found, problems = None, [] if tried else ["the uid level needs root"]
        for name in tried:
            problem = _PROBES[name](readable)
            if not problem:
                found = name
                break
            problems.append(f"{name}: {problem}")
    if found is not None:
        return Level(found, _WHAT[found])
    if mode != "auto":
        raise NoSandbox(f"COURSE_SANDBOX={mode}, and it is not possible here: {'; '.join(problems)}")
    return Level("none", "; ".join(problems))


def _in_child(body) -> str:
    """Run body() in a forked child; what it returned ('' for success) or raised, as text."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(reader)
        try:
            said = body()
        except BaseException as error:  # noqa: BLE001 - reported to the parent as text
            said = f"{type(error).__name__}: {error}"
        os.write(writer, said.encode()[:4000])
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    return said


def _needed(readable: tuple) -> list:
    """What a worker may read: Python's own folders (the standard library, site-packages) and readable."""
    return list(dict.fromkeys(p for p in [*sys.path, *readable] if p and os.path.isdir(p)))


def _probe_uid(readable: tuple) -> str:
    try:
        guard = Guard.start("uid")
    except OSError as error:
        return f"no sandbox user could be taken: {error}"
    needed = _needed(readable)  # here: once its user is taken, what it cannot read is not a folder to it
    try:

        def body():
            _take_uid(guard.handle)
            for folder in needed:
                if not os.access(folder, os.R_OK | os.X_OK):
                    return f"its user cannot read {folder}"
            return ""

        return _in_child(body)
    finally:
        guard.stop()


def _probe_namespaces(readable: tuple) -> str:
    folder = tempfile.mkdtemp(prefix="course-probe-")
    try:
        guard = Guard.start("namespaces")
    except OSError as error:
        os.rmdir(folder)
        return f"the kernel allows no user namespace here ({error})"
    try:
        return _in_child(lambda: _enter_namespaces(guard.handle, folder, fork=False) or "")
    finally:
        guard.stop()
        os.rmdir(folder)


_PROBES = {"uid": _probe_uid, "namespaces": _probe_namespaces}


# ---- in the grading process: what one world holds while it lives --------------------------------


class Guard:
    """What confines one world, held by the process that started it: under ``uid`` the world's
    uid (and the gid of the same number), under ``namespaces`` the process that holds its user
    and network namespaces. ``handle`` (that uid, that process's pid) is what its workers need."""

    def __init__(self, level_name: str, handle: int, release):
        self.level, self.handle, self._release = level_name, handle, release

    @classmethod
    def start(cls, level_name: str) -> Guard:
        if level_name == "uid":
            uid, lock = _take_free_uid()

            def release():
                _kill_every_process_of(uid)
                os.close(lock)

            return cls("uid", uid, release)
        if level_name == "namespaces":
            pid = _start_holder()

            def release():
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):  # reaped already, with its parent's orphans
                    pass

            return cls("namespaces", pid, release)
        raise ValueError(f"no sandbox level {level_name!r}")

    def own(self, folder: str) -> None:
        """Make folder the world's to write: under ``uid``, its group's."""
        if self.level == "uid":
            os.chown(folder, 0, self.handle)
            os.chmod(folder, 0o770)

    def stop(self) -> None:
        """Under ``uid``, kill whatever of its uid still runs and free the uid; under ``namespaces``,
        end the holder (the workers are gone: each took its descendants along)."""
        if self._release is not None:
            release, self._release = self._release, None
            release()

    def forget(self) -> None:
        """In a forked copy of the process that holds it: not this copy's to stop."""
        self._release = None


def _uid_range() -> range:
    first, _, last = os.environ.get("COURSE_SANDBOX_UIDS", "40000-49999").partition("-")
    return range(int(first), int(last) + 1)


def _locks() -> str:
    """A folder of root's for one lock file per uid in use; refused if anyone else could write it."""
    base = "/run" if os.path.isdir("/run") and os.access("/run", os.W_OK) else tempfile.gettempdir()
    folder = os.path.join(base, "course-sandbox")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(folder)
    if os.path.islink(folder) or not os.path.isdir(folder) or st.st_uid != 0 or st.st_mode & 0o077:
        raise PermissionError(f"{folder} must be a folder of root's that no one else may write")
    return folder


def _unused(uid: int) -> bool:
    import grp
    import pwd

    for table in (pwd.getpwuid, grp.getgrgid):
        try:
            table(uid)
            return False
        except KeyError:
            pass
    return True


def _take_free_uid() -> tuple:
    """A uid of COURSE_SANDBOX_UIDS that no account and no other world uses, and its lock (held
    until closed; the kernel frees it when this process dies, however it dies)."""
    import fcntl
    import random

    folder, uids = _locks(), _uid_range()
    start = random.randrange(len(uids))  # graders started together rarely try the same uid first
    for i in range(len(uids)):
        uid = uids[(start + i) % len(uids)]
        if not _unused(uid):
            continue
        lock = os.open(os.path.join(folder, str(uid)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            continue
        _kill_every_process_of(uid)  # what a world of a grader that was itself killed may have left
        return uid, lock
    raise OSError(f"every uid of {uids.start}-{uids.stop - 1} (COURSE_SANDBOX_UIDS) is in use")


def _kill_every_process_of(uid: int) -> None:
    """kill(-1, SIGKILL) from a process of that uid: every process of it, atomically with forks."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:  # none left
            pass
        except BaseException:  # noqa: BLE001 - only the exit status reaches the parent
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError(f"could not stop the processes of uid {uid}")


def _start_holder() -> int:
    """A child that owns a new user and network namespace (its loopback up) until it is killed.

    Once they are made it becomes `sleep`: it keeps no copy of the grader's memory, and, unlike
    the grader, may be entered by the world's workers (/proc/PID/ns/*)."""
    import fcntl
    import socket
    import struct

    uid, gid = os.getuid(), os.getgid()
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        said = b""
        try:
            os.close(reader)
            die_with_parent()
            # The grader is not dumpable (protect()), and the /proc files of a process that is not
            # are root's: this one could not write its own uid_map. It becomes `sleep` below.
            prctl(_PR_SET_DUMPABLE, 1)
            _call("unshare", _CLONE_NEWUSER | _CLONE_NEWNET)
            _map_ids(uid, gid)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                up, loopback, running = 1, 8, 0x40
                fcntl.ioctl(s, 0x8914, struct.pack("16sh22x", b"lo", up | loopback | running))  # SIOCSIFFLAGS
        except BaseException as error:  # noqa: BLE001 - said to the parent
            said = f"{type(error).__name__}: {error}".encode()
        os.write(writer, said or b"ready")
        os.close(writer)
        if not said:
            try:
                os.execvp("sleep", ["sleep", "2147483647"])
            except OSError:
                pass
        os._exit(1)
    os.close(writer)
    with os.fdopen(reader, "rb") as f:
        said = f.read().decode()
    if said != "ready":
        os.waitpid(pid, 0)
        raise OSError(said)
    return pid


def _map_ids(uid: int, gid: int) -> None:
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


# ---- in the worker -----------------------------------------------------------------------------


def confine(level_name: str, handle: int | None, folder: str) -> None:
    """Confine this worker before it runs submission code: ``folder`` is the world's own, ``handle``
    its Guard's.

    Under ``namespaces`` this process forks: it stays outside as its rank's supervisor, and only
    the child, process 1 of the new pid namespace, returns from here.
    """
    if level_name == "uid":
        _take_uid(handle)
        die_with_parent()  # again: the kernel clears it when the process changes its user
        _no_unix_sockets()
    elif level_name == "namespaces":
        _enter_namespaces(handle, folder, fork=True)
    elif level_name != "none":
        raise ValueError(f"no sandbox level {level_name!r}")
    if level_name != "none":
        # A session of its own: a signal to "my process group" (kill(0), as os.kill(os.getppid())
        # reads in a pid namespace, whose parent is 0) reaches across pid namespaces, and would
        # reach the grader's group; and no controlling terminal to type into (TIOCSTI).
        os.setsid()


def _drop_bounding_set() -> None:
    """No capability to regain by executing a program (a file's capabilities, root's exec)."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for capability in range(last + 1):
        prctl(_PR_CAPBSET_DROP, capability)


def _take_uid(uid: int) -> None:
    import resource

    _drop_bounding_set()
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from root to another user: every capability goes
    prctl(_PR_SET_NO_NEW_PRIVS, 1)
    resource.setrlimit(resource.RLIMIT_NPROC, (_MOST_PROCESSES, _MOST_PROCESSES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _mount(source, target: str, fstype, flags: int, data: str | None = None) -> None:
    encode = lambda s: s.encode() if s is not None else None  # noqa: E731
    _call("mount", encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data))


def _mount_points() -> list:
    """(mount point, the flags a namespace must keep) of every mount this process sees."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # octal escapes: \040 is a space
            flags = 0
            for option in fields[5].split(","):
                flags |= _LOCKED.get(option, 0)
            points.append((point, flags))
    return points


def _enter_namespaces(holder: int, folder: str, fork: bool) -> None:
    for kind, flag in (("user", _CLONE_NEWUSER), ("net", _CLONE_NEWNET)):  # the world's, shared by its ranks
        fd = os.open(f"/proc/{holder}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _call("setns", fd, flag)
        finally:
            os.close(fd)
    _call("unshare", _CLONE_NEWNS | _CLONE_NEWPID)
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing done here reaches the grader's mounts
    _mount(folder, folder, None, _MS_BIND)  # a mount of its own, to be left writable
    for point, flags in _mount_points():
        writable = point == folder
        try:
            _mount(None, point, None, _MS_REMOUNT | _MS_BIND | (0 if writable else _MS_RDONLY) | flags)
        except OSError:
            if point in ("/", folder):
                raise
    if os.access("/", os.W_OK) or not os.access(folder, os.W_OK):
        raise OSError("the worker's mounts did not become read-only")
    if not fork:
        return
    child = os.fork()  # a new pid namespace holds this process's children, not itself
    if child:
        _supervise(child)
    die_with_parent()
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)  # this namespace's processes only
    _drop_bounding_set()
    _drop_capabilities()
    prctl(_PR_SET_NO_NEW_PRIVS, 1)
    _no_unix_sockets()


def _drop_capabilities() -> None:
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    _call("capset", ctypes.byref(Header(0x20080522, 0)), ctypes.byref((Data * 2)()))  # version 3: all zero


# seccomp: (AUDIT_ARCH, socket's syscall number) of the architectures the filter knows.
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}


def _no_unix_sockets() -> None:
    """From now on socket(AF_UNIX, ...) fails with EACCES in this process and its children (a
    seccomp filter; needs no_new_privs). Other architectures' system calls fail too (an i386 call
    on x86-64 could name another socket()); elsewhere than x86-64 and arm64 there is no filter."""
    known = _SECCOMP_ARCH.get(platform.machine())
    if known is None:
        return
    arch, socket_call = known
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, refuse = 0x7FFF0000, 0x00050000 | 13  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EACCES
    program = [
        (ld, 0, 0, 4),  # the architecture
        (jeq, 1, 0, arch),
        (ret, 0, 0, refuse),
        (ld, 0, 0, 0),  # the system call's number
        (jge, 4, 0, 0x40000000),  # x32's numbers (x86-64): refused
        (jeq, 0, 2, socket_call),
        (ld, 0, 0, 16),  # socket's first argument, the domain
        (jeq, 1, 0, 1),  # AF_UNIX
        (ret, 0, 0, allow),
        (ret, 0, 0, refuse),
    ]

    class Instruction(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Instruction))]

    instructions = (Instruction * len(program))(*[Instruction(*i) for i in program])
    _call(
        "prctl", 22, ctypes.c_ulong(2), ctypes.byref(Program(len(program), instructions)), 0, 0
    )  # PR_SET_SECCOMP, FILTER


def _supervise(child: int) -> None:
    """The rank's process outside the pid namespace: hand on the parent's requests for a stack
    (SIGUSR1, course/workers.py) and end as the child ends."""
    signal.signal(signal.SIGUSR1, lambda *_: os.kill(child, signal.SIGUSR1))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            os._exit(1)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # killed by a signal: so is this process, so that the parent sees the same
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def in_own_namespace() -> bool:
    """Whether this worker is process 1 of a pid namespace of its own (the namespaces level)."""
    return LINUX and os.getpid() == 1
