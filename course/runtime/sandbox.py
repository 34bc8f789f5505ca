"""Where graded code runs: worker processes that cannot see, signal, trace or write the grader's.

The checks run submission code only in the workers of grading worlds (checks/helpers.py calls
``run(..., sandbox=True)``, course/runtime/workers.py). Those workers are confined before the first line
of a submission runs, as far as the machine allows (``level()``):

- ``uid`` (Linux, the grader runs as root: Gradescope, a container). A world gets a user and group
  id of its own, from a range no account uses (COURSE_SANDBOX_UIDS, default 40000-49999), held by
  a lock file while the world lives. Its workers take it with no capability left (the bounding
  set emptied too), no new privileges and a cap on their processes. A process of another user
  cannot be traced, read or written by them (/proc/PID/mem, /proc/PID/fd, pidfd_getfd), nor
  signalled; root's files, folders and sockets are not theirs to write or connect to. The world's
  own folder (its store, HOME and TMPDIR) is the one folder made for them. When the
  world ends, every process of its uid dies at once: kill(-1) from a process of that uid, which no
  fork can outrun (the kernel signals under the lock that fork takes to add a process). A world
  has a network namespace of its own too, which root makes (a kernel that gives none refuses the
  level, with the reason). This level needs a Python, a course and a submission that the world's
  user can read in its view (below); where they are not, root gets the next level.
- ``namespaces`` (Linux, where the kernel allows user namespaces: a normal user on a laptop or an
  instructor's machine, or root as above). A world gets a holder process that owns a user and a
  network namespace: its ranks join them, so they reach each other over loopback and nothing
  else (no port of the machine: a notebook kernel's, a server's; no abstract socket). Each rank
  then gets a mount and a pid namespace of its own: every mount read-only but its world's own folder,
  no process but its own descendants, all killed by the kernel when it ends (it is process 1 of
  its namespace), and no capability left.
- ``none`` elsewhere (macOS, Windows, a kernel without user namespaces), or COURSE_SANDBOX=off.
  The grade is then advisory.

Where grades are made (workers.sandbox_every_world()), each rank of either level also gets a view
before it takes its uid or drops its capabilities: its root is a tmpfs with the machine's system
folders, Python, the course's public files and the one submission graded bound in, read-only, and
the world's own folder, writable (view(), publish()). Where a level is had but no view can be made, the
level's grades say they are advisory (Level.advisory).

At both levels a world has limits (Limits): its own folder is a tmpfs of a few hundred MiB in a
mount namespace its holder makes (no file of it is on the grader's disk; the grader's folder for the
world, with the public files and each rank's stack file and board, is not the ranks' to write), no
rank writes a file larger than a limit anywhere, and each rank's memory is bounded.

At both levels a worker may not create a unix-domain socket (a seccomp filter, x86-64 and arm64):
no connection to a socket of the user's or world-writable one (multiprocessing's servers, an SSH
agent, X11, systemd's user bus), in a folder or in the abstract namespace. Nor may it set up an
io_uring, whose requests (an open among them) pass no system call's tracepoint: the kernel's count of
the files a rank names (course/runtime/uprobes.py) sees every one.

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
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass

from course.runtime.processes import ctrl_c_held

LINUX = sys.platform.startswith("linux")

_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 4, 24, 36, 38
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
_CLONE_NEWIPC = 0x08000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_MS_REC, _MS_PRIVATE = 16384, 1 << 18
# A mount's flags that a user namespace may not clear (the kernel locks them): kept when remounting.
_LOCKED = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC, "noatime": 1024, "nodiratime": 2048}
_LOCKED |= {"relatime": 1 << 21, "strictatime": 1 << 24}
# Processes (threads count) one world's uid may have: a fork bomb stops there, not at the machine's limit.
MOST_PROCESSES = 1024
_MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """What one sandboxed world may take of the machine, in MiB, so that no submission can fill the
    grader's disk or memory: ``disk``, all the files of its own folder together (a tmpfs of that size,
    own_folder()); ``file``, the largest file a rank may write, wherever (its output too, where that
    is a file: an autograded notebook's); ``memory``, the data each rank may allocate (RLIMIT_DATA:
    its tensors and objects, not the libraries it maps). COURSE_LIMIT_DISK, COURSE_LIMIT_FILE and
    COURSE_LIMIT_MEMORY change them, in MiB; the course's checks need a few MiB of disk and under
    1 GiB of memory a rank."""

    disk: int = 256
    file: int = 16
    memory: int = 4096

    @classmethod
    def from_env(cls) -> Limits:
        given = {name: os.environ.get(f"COURSE_LIMIT_{name.upper()}") for name in ("disk", "file", "memory")}
        return cls(**{name: int(value) for name, value in given.items() if value})

    def apply(self) -> None:
        """In a rank, before any code under test: its own limits (those of a call it forks too)."""
        import resource

        for kind, mib in ((resource.RLIMIT_FSIZE, self.file), (resource.RLIMIT_DATA, self.memory)):
            resource.setrlimit(kind, (mib * _MIB, mib * _MIB))


LIMITS = Limits.from_env()
# Files of a world's own folder: each costs the kernel memory beside its bytes.
_MOST_FILES = 16384


def own_folder(folder: str) -> str:
    """The one folder of the world whose grader's folder is ``folder`` that its ranks may write: their
    store, HOME and TMPDIR. In a sandbox, a tmpfs of LIMITS.disk MiB in the world's own mount
    namespace; the grader's folder around it (the public files, each rank's stack file and board)
    is not theirs to write."""
    return os.path.join(folder, "own")


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


def name_process(name: str) -> None:
    """This process's name, as ps and /proc/PID/comm show it (Linux; at most 15 bytes)."""
    if LINUX:
        _call("prctl", 15, ctypes.c_char_p(name.encode()[:15]), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


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
    unseen: str = ""  # why the workers cannot be given a view of their own submission only (view()), if they cannot

    @property
    def advisory(self) -> str:
        """Why a grade made at this level is advisory; '' when it is not."""
        if self.name == "none":
            return f"submission code ran without a sandbox ({self.reason})"
        if self.unseen:
            return f"submission code could read files other than its own ({self.unseen})"
        return ""

    def line(self) -> str:
        """One line for the grade's output."""
        if self.name == "none":
            return f"Submission code ran without a sandbox ({self.reason}): this grade is advisory."
        if self.unseen:
            return f"Submission code ran sandboxed: {self.reason}; {self.advisory}: this grade is advisory."
        return f"Submission code ran sandboxed: {self.reason}."


class NoSandbox(RuntimeError):
    """COURSE_SANDBOX asks for a sandbox that this machine does not allow."""


_WHAT = {
    "uid": "each world a user and a network namespace of its own, with no capabilities",
    "namespaces": "each world its own user and network namespace, each rank its own read-only mounts and pids",
}
_IN_VIEW = ", in a view of the course's public files and its own submission"


@functools.cache
def level(readable: tuple = (), submission: str | None = None) -> Level:
    """The sandbox that grading worlds get on this machine (COURSE_SANDBOX), tried once per process.

    ``readable``: folders the workers must read (the course, the submission, torch), besides
    Python's own: the ``uid`` level needs its user to read them all. ``submission``: the code
    that is graded, whose view (view()) is tried too: where it cannot be made, the level stays,
    and says why its grades are advisory.
    """
    mode = os.environ.get("COURSE_SANDBOX") or "auto"  # set but empty: as if unset
    if mode not in ("auto", "required", "off", "uid", "namespaces"):
        raise ValueError(f"COURSE_SANDBOX is {mode!r}: auto, required, uid, namespaces or off")
    if mode == "off":
        return Level("none", "COURSE_SANDBOX=off")
    if not LINUX:
        found, problems = None, [f"no sandbox on {sys.platform}"]
    else:
        # Namespaces first, for root too: its workers see no process but their own, and a world starts
        # faster (the whole grade of the reference: 26 s against 39 s at the uid level, as root here).
        # The uid level is for where the kernel gives root no user namespace (a container's default).
        tried = [name for name in ("namespaces", "uid") if mode in (name, "auto", "required")]
        if os.geteuid() != 0 and "uid" in tried:
            tried.remove("uid")
        found, problems = None, [] if tried else ["the uid level needs root"]
        for name in tried:
            problem, unseen = _PROBES[name](readable, submission)
            if not problem:
                found = name
                break
            problems.append(f"{name}: {problem}")
    if found is not None:
        return Level(found, _WHAT[found] + ("" if unseen or submission is None else _IN_VIEW), unseen)
    if mode != "auto":
        raise NoSandbox(f"COURSE_SANDBOX={mode}, and it is not possible here: {'; '.join(problems)}")
    return Level("none", "; ".join(problems))


@ctrl_c_held()
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


def _probe(start, enter, submission: str | None, check=lambda: "") -> tuple:
    """(why the level cannot be had, why its workers cannot have a view) of a level whose Guard
    start() makes and whose worker enter(guard, folder, submission) confines; check(), in the
    confined worker: '' or what it lacks."""
    folder = tempfile.mkdtemp(prefix="course-probe-")
    try:
        guard = start(folder)
    except OSError as error:
        shutil.rmtree(folder, ignore_errors=True)
        return str(error), ""
    try:
        confined = lambda entries: lambda: enter(guard, folder, entries) or check()  # noqa: E731
        unseen = ""
        if submission is not None:
            try:
                entries = view(submission)
                publish(folder, entries)
            except OSError as error:
                unseen = f"{type(error).__name__}: {error}"
            unseen = unseen or _in_child(confined(entries))
        # Without a view the workers need what the level gives them as it is (the uid level: a Python
        # its user can read); with one, the view holds it.
        return (_in_child(confined(None)) if unseen or submission is None else ""), unseen
    finally:
        guard.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _probe_uid(readable: tuple, submission: str | None) -> tuple:
    needed = _needed(readable)  # once its user is taken, what it cannot read is not a folder to it

    def start(folder):
        try:
            return Guard.start("uid", folder)
        except OSError as error:
            raise OSError(f"no sandbox user or network namespace could be had: {error}") from error

    def check():
        return next((f"its user cannot read {f}" for f in needed if not os.access(f, os.R_OK | os.X_OK)), "")

    return _probe(start, lambda guard, folder, sub: _enter_uid(*guard.handle, folder, sub), submission, check)


def _probe_namespaces(readable: tuple, submission: str | None) -> tuple:
    def start(folder):
        try:
            return Guard.start("namespaces", folder)
        except OSError as error:
            raise OSError(f"the kernel allows no user namespace here ({error})") from error

    return _probe(
        start, lambda guard, folder, sub: _enter_namespaces(guard.handle, folder, sub, fork=False), submission
    )


_PROBES = {"uid": _probe_uid, "namespaces": _probe_namespaces}


# ---- in the grading process: what one world holds while it lives --------------------------------


class Guard:
    """What confines one world, held by the process that started it: the process that holds its
    network, IPC and mount namespaces (``holder``; under ``namespaces`` its user namespace too), and
    under ``uid`` the world's uid (and the gid of the same number). ``handle`` is what its workers
    need: under ``uid`` (uid, holder), under ``namespaces`` the holder."""

    def __init__(self, level_name: str, handle, holder: int, release):
        self.level, self.handle, self.holder, self._release = level_name, handle, holder, release

    @classmethod
    def start(cls, level_name: str, folder: str) -> Guard:
        """Confine the world whose grader's folder is ``folder``: its own folder (own_folder()) is made
        there, a tmpfs in the holder's mount namespace, the world's uid's to write under ``uid``."""
        if level_name not in ("uid", "namespaces"):
            raise ValueError(f"no sandbox level {level_name!r}")
        uid, lock = _take_free_uid() if level_name == "uid" else (None, None)
        try:
            os.mkdir(own_folder(folder), 0o700)
            if uid is not None:  # its user may pass through the grader's folder to its own, and no more
                os.chown(folder, 0, uid)
                os.chmod(folder, 0o710)
            holder = _start_holder(own_folder(folder), uid)
        except BaseException:
            if lock is not None:
                os.close(lock)
            raise

        def release():
            if uid is not None:
                _kill_every_process_of(uid)
                os.close(lock)
            try:
                os.kill(holder, signal.SIGKILL)
                os.waitpid(holder, 0)
            except (ProcessLookupError, ChildProcessError):  # reaped already, with its parent's orphans
                pass

        return cls(level_name, (uid, holder) if uid is not None else holder, holder, release)

    def loopback_bytes(self) -> int:
        """The bytes the world's own loopback has carried since it began, as the kernel counts them (read
        here, in the grader, where no code of the world runs): all that its ranks sent one another over
        the network, IP and TCP headers included."""
        with open(f"/proc/{self.holder}/net/dev") as f:  # the network namespace of the holder: the world's
            for line in f:
                name, _, counts = line.partition(":")
                if name.strip() == "lo":
                    return int(counts.split()[0])
        raise OSError("the world's network namespace has no loopback")

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


@ctrl_c_held()
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


@ctrl_c_held()
def _start_holder(own: str, uid: int | None) -> int:
    """A child that owns new network, IPC and mount namespaces until it is killed: its loopback up;
    System V shared memory, semaphores and message queues that none outlives the world and none is
    another's; and the world's own folder ``own``, a tmpfs of LIMITS.disk MiB that only the world's
    processes see (the world's ``uid``'s, where given). Without ``uid`` (the namespaces level) in a
    new user namespace too; with it (root, the uid level) the namespaces are root's to make, and the
    world's workers join them before they take their uid.

    Once they are made it becomes `sleep`: it keeps no copy of the grader's memory, and, unlike
    the grader, may be entered by the world's workers (/proc/PID/ns/*)."""
    import fcntl
    import socket
    import struct

    user, outside = uid is None, (os.getuid(), os.getgid())
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
            _call("unshare", (_CLONE_NEWUSER if user else 0) | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWNS)
            if user:
                _map_ids(*outside)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                up, loopback, running = 1, 8, 0x40
                fcntl.ioctl(s, 0x8914, struct.pack("16sh22x", b"lo", up | loopback | running))  # SIOCSIFFLAGS
            _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # the tmpfs is the world's, not the grader's
            owner = "" if user else f",uid={uid},gid={uid}"
            size = f"size={LIMITS.disk}m,nr_inodes={_MOST_FILES},mode=0700{owner}"
            _mount("tmpfs", own, "tmpfs", _MS_NOSUID | _MS_NODEV, size)
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


# ---- what a grading world sees ------------------------------------------------------------------

# The machine's folders that programs need (libraries, devices, settings); the rest of it is not
# in a view: the home folders, /tmp, /run, /srv, wherever courses, grades and submissions live.
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/dev", "/sys", "/proc")


def _holds(folder: str, path: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


@functools.cache
def view(submission: str) -> tuple:
    """What the workers grading ``submission`` see: (path, "dir", "file" or "link", what is bound
    there), in the order they are made. The machine's folders of _SYSTEM, Python and its packages,
    the course's public files as the students' copy has them (publish(), bound from the world's
    folder: None), and that submission; not solutions/, nor the grader's or instructors' other
    files, nor any folder around the submission (its classmates', the grades)."""
    from course.layout import ROOT, SOLUTIONS

    around = (ROOT, os.path.dirname(submission))  # a folder that holds either shows what it must not

    def shown(path: str) -> bool:
        if not path or any(_holds(path, p) for p in around):
            return False
        return submission == SOLUTIONS or not _holds(SOLUTIONS, path)

    python = [sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix, *sys.path]
    python.append(os.path.dirname(os.path.realpath(sys.executable)))
    candidates = [*_SYSTEM, *filter(shown, map(os.path.abspath, filter(None, python)))]
    if shown(submission):
        candidates.append(submission)
    found = {}
    for path in sorted(set(candidates)):
        if any(_holds(other, path) for other, kind in found.items() if kind == "dir") or not os.path.lexists(path):
            continue
        found[path] = "link" if os.path.islink(path) else "dir" if os.path.isdir(path) else "file"
    return tuple(sorted([(ROOT, "dir", None), *((p, kind, p) for p, kind in found.items())]))


@functools.cache
def _public_files(root: str) -> tuple:
    """The course's public files, relative to root (course/instructors/release.py); () in the students' copy,
    all of which is public. Markdown files are left out: an instructors' copy has parts the
    students' has not, and no check reads one."""
    from course.layout import instructors_repository, released_files

    if not instructors_repository(root):
        return ()
    return tuple(p for p in released_files(root) if not p.endswith(".md"))


def publish(folder: str, entries: tuple) -> None:
    """Before a world's workers start, in the grader: the course's public files in folder/public,
    to be seen at the course's place in its view (view()'s ``entries``), with an empty place for
    what the view binds inside the course (the venv, the submission). In the students' copy, none:
    the course itself is bound there."""
    from course.layout import ROOT

    files = _public_files(ROOT)
    if not files:
        return
    public = os.path.join(folder, "public")
    for path in files:
        os.makedirs(os.path.dirname(os.path.join(public, path)), exist_ok=True)
        shutil.copyfile(os.path.join(ROOT, path), os.path.join(public, path))
    for path, kind, _ in entries:
        if _holds(ROOT, path) and path != ROOT and kind != "link":
            place = os.path.join(public, os.path.relpath(path, ROOT))
            os.makedirs(place if kind == "dir" else os.path.dirname(place), exist_ok=True)
            if kind == "file":
                open(place, "w").close()
    for top, _, names in os.walk(public):  # every user's to read (the uid level's), whatever the umask
        os.chmod(top, 0o755)
        for name in names:
            os.chmod(os.path.join(top, name), 0o644)


def _build_view(folder: str, entries: tuple) -> str:
    """The view of entries (view()) in a tmpfs at folder/view, with the world's own folder in it; its path."""
    from course.layout import ROOT

    root = os.path.join(folder, "view")
    os.makedirs(root, exist_ok=True)
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=755")
    public = os.path.join(folder, "public") if _public_files(ROOT) else ROOT
    for path, kind, source in (*entries, (own_folder(folder), "world", own_folder(folder))):
        target = root + path
        if os.path.lexists(target):  # a place made for it in what is bound above it, or that link
            pass
        elif kind == "link":
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            os.symlink(os.readlink(path), target)
        elif kind == "file":
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            open(target, "w").close()
        else:
            os.makedirs(target, mode=0o755, exist_ok=True)
        if kind != "link":
            _mount(source or public, target, None, _MS_BIND | (0 if kind == "world" else _MS_REC))
    return root


# ---- in the worker -----------------------------------------------------------------------------


def confine(level_name: str, handle, folder: str, entries: tuple | None = None) -> None:
    """Confine this worker before it runs submission code: ``folder`` is the grader's for the world
    (Guard.start's), ``handle`` its Guard's; with ``entries`` (where grades are made: view()), the
    worker sees only them. It may write its world's own folder only, within LIMITS.

    Under ``namespaces`` this process forks: it stays outside as its rank's supervisor, and only
    the child, process 1 of the new pid namespace, returns from here.
    """
    if level_name == "uid":
        _enter_uid(*handle, folder, entries)
        die_with_parent()  # again: the kernel clears it when the process changes its user
        _refuse_calls()
    elif level_name == "namespaces":
        _enter_namespaces(handle, folder, entries, fork=True)
    elif level_name != "none":
        raise ValueError(f"no sandbox level {level_name!r}")
    if level_name != "none":
        # A session of its own: a signal to "my process group" (kill(0), as os.kill(os.getppid())
        # reads in a pid namespace, whose parent is 0) reaches across pid namespaces, and would
        # reach the grader's group; and no controlling terminal to type into (TIOCSTI).
        os.setsid()
        LIMITS.apply()


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
    resource.setrlimit(resource.RLIMIT_NPROC, (MOST_PROCESSES, MOST_PROCESSES))
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


def _join(holder: int, kinds: tuple) -> None:
    """Enter the namespaces of the world's holder: ("user", "mnt", "net", "ipc") under namespaces,
    ("mnt", "net", "ipc") under uid. The working folder stays (a mount namespace entered resets it)."""
    flags = {"user": _CLONE_NEWUSER, "mnt": _CLONE_NEWNS, "net": _CLONE_NEWNET, "ipc": _CLONE_NEWIPC}
    cwd = os.getcwd()
    for kind in kinds:
        fd = os.open(f"/proc/{holder}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _call("setns", fd, flags[kind])
        finally:
            os.close(fd)
    os.chdir(cwd)


def _read_only_but(folder: str, entries: tuple | None) -> None:
    """In a mount namespace of this process's own: every mount read-only, but the world's own folder
    (own_folder()); with ``entries``, the root of this process its view (view()), built in folder."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing done here reaches the grader's mounts
    own = own_folder(folder)
    if entries is None:
        root, writable = "/", own
    else:
        root = _build_view(folder, entries)
        writable = root + own
    for point, flags in _mount_points():
        try:
            _mount(None, point, None, _MS_REMOUNT | _MS_BIND | (0 if point == writable else _MS_RDONLY) | flags)
        except OSError:
            if point in ("/", root, writable):
                raise
    shm = os.path.join(root, "dev", "shm")
    if os.path.isdir(shm):
        # Shared memory of the rank's own: multiprocessing's locks need a writable /dev/shm (torch's
        # distributed checkpoint imports them), and the machine's, read-only here, is every world's.
        try:
            _mount("tmpfs", shm, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "mode=1777,size=256m")
        except OSError:  # a kernel that refuses: the rank has none, as before
            pass
    if root != "/":
        cwd = os.getcwd()
        os.chroot(root)
        try:
            os.chdir(cwd)
        except OSError:  # a working folder outside the view
            os.chdir(own)
    if os.access("/", os.W_OK) or not os.access(own, os.W_OK):
        raise OSError("the worker's mounts did not become read-only")


def _enter_uid(uid: int, holder: int, folder: str, entries: tuple | None) -> None:
    """As root: the world's namespaces; with entries, a mount namespace of its own and that view;
    then the world's uid, with no capability left."""
    _join(holder, ("mnt", "net", "ipc"))
    if entries is not None:
        _call("unshare", _CLONE_NEWNS)
        _read_only_but(folder, entries)
    _take_uid(uid)


def _enter_namespaces(holder: int, folder: str, entries: tuple | None, fork: bool) -> None:
    _join(holder, ("user", "mnt", "net", "ipc"))  # the world's, shared by its ranks
    _call("unshare", _CLONE_NEWNS | _CLONE_NEWPID)
    _read_only_but(folder, entries)
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
    _refuse_calls()


def _drop_capabilities() -> None:
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    _call("capset", ctypes.byref(Header(0x20080522, 0)), ctypes.byref((Data * 2)()))  # version 3: all zero


# seccomp: (AUDIT_ARCH, socket's syscall number, io_uring_setup's) of the architectures the filter knows.
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 41, 425), "aarch64": (0xC00000B7, 198, 425)}


def _refuse_calls() -> None:
    """From now on socket(AF_UNIX, ...) and io_uring_setup fail with EACCES in this process and its
    children (a seccomp filter; needs no_new_privs). Other architectures' system calls fail too (an
    i386 call on x86-64 could name another socket()); elsewhere than x86-64 and arm64 there is no filter."""
    known = _SECCOMP_ARCH.get(platform.machine())
    if known is None:
        return
    arch, socket_call, io_uring_setup = known
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, refuse = 0x7FFF0000, 0x00050000 | 13  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EACCES
    program = [
        (ld, 0, 0, 4),  # the architecture
        (jeq, 1, 0, arch),
        (ret, 0, 0, refuse),
        (ld, 0, 0, 0),  # the system call's number
        (jge, 5, 0, 0x40000000),  # x32's numbers (x86-64): refused
        (jeq, 4, 0, io_uring_setup),
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
    (SIGUSR1, course/runtime/workers.py) and end as the child ends."""
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
