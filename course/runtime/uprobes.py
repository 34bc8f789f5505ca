"""Which of torch's parts a world's processes used, as the kernel counts them (Linux uprobes and system calls).

An exercise that teaches a part of torch to be written by hand forbids torch's own (course/exercises.py's
``forbids``). A record of that kept in a worker is the submission's to rewrite; this one is not: the
grader asks the kernel, before any code under test runs, to count each entry below in every thread and
process of each rank (a perf event on a tracepoint, inherited by what they start), and reads the counts
itself. An entry is either C++ functions that every path to the forbidden part goes through (a uprobe
on each): torch's DistributedDataParallel (and ``replicate``) makes a ``c10d::Reducer``; every
collective of a gloo group, by ``dist``, a functional collective or DDP's own, enters a method of
``ProcessGroupGloo``. Or the files of a part written in Python only: its code is had by opening them,
which a rank does once it imports it, as no rank holds it before (``available`` says where one does);
the kernel counts the system calls that name a path of them (to open one, or a folder holding them, or
to change into one or link to one), a filter on each one's tracepoint keeping those paths.

The kernel gives these to a process that may monitor others (root, or CAP_PERFMON): where grades are
made. Elsewhere (a student's laptop, a container whose seccomp refuses perf_event_open) ``Counter.attach``
gives None and nothing is counted.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import struct
import sys
from dataclasses import dataclass

from course.runtime.processes import descendants, processes

try:  # imported here, before any code under test runs (the grader imports nothing after: docs/trust.md)
    import fcntl
    import resource
except ImportError:  # Windows, where the kernel counts nothing for the course
    fcntl = resource = None


@dataclass(frozen=True)
class Entry:
    called: str  # what a call of one means, for a sentence: "torch's DistributedDataParallel"
    counted: str  # what the kernel counted calls of, for a sentence: "c10d::Reducer's constructor"
    library: str = ""  # in torch/lib
    symbols: tuple = ()  # the start of the mangled name of each function counted
    paths: tuple = ()  # or: what every path to its files holds, and no other file's of torch's (no "*" in one)
    modules: tuple = ()  # and its modules, by name: a folder's package, or the module that is the file

    def seen(self, count: int) -> str:
        """What the kernel counted, in words: "3 calls of gloo's collectives"."""
        if self.paths:
            return (
                f"{count} system call{'s' * (count != 1)} naming {self.counted} (or a path of {_LONG} bytes or more,"
                " longer than the kernel's filter reads)"
            )
        return f"{count} call{'s' * (count != 1)} of {self.counted}"


# gloo's collectives: every method of ProcessGroupGloo but its messages (send, recv), its barrier, its housekeeping,
# and the list all-gather (allgather), which the course's own check of collectives makes before each one, the
# barrier that ends every call included (course/runtime/instrument.py's Agreement); dist.all_gather is the
# communication log's (checks/comm_log.py), torch's other all-gathers (the functional one's) are counted here.
_GLOO_COLLECTIVES = (
    "_allgather_base _reduce_scatter_base allgather_coalesced allgather_into_tensor_coalesced allreduce"
    " allreduce_coalesced allreduce_sparse alltoall alltoall_base broadcast gather reduce reduce_scatter"
    " reduce_scatter_tensor_coalesced scatter"
).split()

ENTRIES = {
    "DistributedDataParallel": Entry(
        "torch's DistributedDataParallel",
        "c10d::Reducer's constructor",
        "libtorch_cpu.so",
        ("_ZN4c10d7ReducerC2",),
    ),
    "collective": Entry(
        "a collective of torch's (by any path: dist.all_reduce, a functional collective, DDP's)",
        "gloo's collectives",
        "libtorch_cpu.so",
        tuple(f"_ZN4c10d16ProcessGroupGloo{len(name)}{name}E" for name in _GLOO_COLLECTIVES),
    ),
    # Python only, and imported by nothing of torch's that the course runs (torch._dynamo, which an optimizer's
    # step imports, brings torch.distributed.fsdp and torch.distributed.tensor: those no count can tell apart).
    "ZeroRedundancyOptimizer": Entry(
        "torch's ZeroRedundancyOptimizer",
        "torch/distributed/optim/zero_redundancy_optimizer's file",
        paths=("zero_redundancy_optimizer",),
        modules=("torch.distributed.optim.zero_redundancy_optimizer",),
    ),
    "comm_hooks": Entry(
        "torch's DDP communication hooks (torch.distributed.algorithms.ddp_comm_hooks)",
        "the files of torch/distributed/algorithms/ddp_comm_hooks",
        paths=("ddp_comm_hooks",),
        modules=("torch.distributed.algorithms.ddp_comm_hooks",),
    ),
    # Every DTensor is made by its C++ constructor, and every operation on one enters its C++ dispatch: torch's
    # fully_shard and parallelize_module make their parameters DTensors. Both functions are local to torch's Python
    # bindings (their symbol table's, where the wheel keeps it: torch 2.13's does).
    "DTensor": Entry(
        "torch's DTensor (fully_shard, parallelize_module, distribute_tensor and DTensor.from_local make one)",
        "DTensor's C++ constructor and dispatch",
        "libtorch_python.so",
        (
            "_ZL23THPVariable_dtensor_newP7_objectS0_S0_",
            "_Z17dispatchDTensorOpRKN3c1014OperatorHandleEN8pybind116handleES4_S4_PSt6vectorINS_6IValueESaIS6_EE",
        ),
    ),
    "model_averaging": Entry(
        "torch's model averaging (torch.distributed.algorithms.model_averaging: average_parameters,"
        " PeriodicModelAverager, and PostLocalSGDOptimizer, which uses them)",
        "the files of torch/distributed/algorithms/model_averaging",
        paths=("model_averaging",),
        modules=("torch.distributed.algorithms.model_averaging",),
    ),
    "pipelining": Entry(
        "torch's pipelining (torch.distributed.pipelining)",
        "the files of torch/distributed/pipelining",
        paths=("pipelining",),
        modules=("torch.distributed.pipelining",),
    ),
}

# The system calls that name a path (its field): to open a file or a folder (whose descriptor opens what it holds by
# a relative name), to change into a folder (the same, from the working folder), to link to one (a hard link too,
# which the kernel refuses to a file of another user's where fs.protected_hardlinks is set, as it is by default). A filter on each
# one's tracepoint keeps those that name an entry's paths.
_NAMING = (
    ("sys_enter_mount", "dev_name"),  # a bind mount of its folder, where a rank may mount (root, without a sandbox)
    ("sys_enter_open_tree", "filename"),  # the same by the new mount calls
    ("sys_enter_open", "filename"),
    ("sys_enter_openat", "filename"),
    ("sys_enter_openat2", "filename"),
    ("sys_enter_chdir", "filename"),
    ("sys_enter_symlink", "oldname"),
    ("sys_enter_symlinkat", "oldname"),
    ("sys_enter_link", "oldname"),
    ("sys_enter_linkat", "oldname"),
)

# The kernel's filter reads the first 1024 bytes of a path: a name past them (a path padded with "./") passes unseen.
# So every path of _LONG bytes or more counts too (a glob of as many "?"; a filter's pattern holds 255 at most): none
# of the course's, nor torch's own, is that long (torch's longest file path is 173 bytes, its licences included).
_LONG = 250
_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}.get(platform.machine())
_TRACEPOINT = 2  # PERF_TYPE_TRACEPOINT
_INHERIT = 1 << 1
_FD_CLOEXEC = 8
_SET_FILTER = 0x40082406  # PERF_EVENT_IOC_SET_FILTER
_TRACING = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")


class _Attr(ctypes.Structure):  # perf_event_attr up to config2 (PERF_ATTR_SIZE_VER1)
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("wakeup_events", ctypes.c_uint32),
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),
        ("config2", ctypes.c_uint64),
    ]


def _file_offsets(path: str, symbols: tuple) -> list:
    """Where each symbol's code starts in the shared library's file (None where it has none): its address less that of
    the loaded segment holding it, plus the segment's offset in the file (ELF64, little-endian). Reads the headers and
    the symbol tables only, each once: torch's library is hundreds of MB."""
    with open(path, "rb") as f:

        def read(offset, size):
            f.seek(offset)
            return f.read(size)

        head = read(0, 64)
        if head[:6] != b"\x7fELF\x02\x01":
            return [None] * len(symbols)
        phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
        table = read(shoff, shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]
        addresses = dict.fromkeys(symbols)
        # SHT_DYNSYM, the exported symbols, then SHT_SYMTAB, every symbol where the library keeps them (a function
        # local to its file: DTensor's in torch's Python bindings), read only for a symbol not found yet; each names
        # its string table (link).
        for _, _, _, _, offset, size, link, _, _, entsize in [s for kind in (11, 2) for s in sections if s[1] == kind]:
            wanted = [symbol for symbol, address in addresses.items() if address is None]
            if not wanted:
                break
            entries, names = read(offset, size), read(sections[link][4], sections[link][5])
            for symbol in wanted:
                addresses[symbol] = _address(symbol.encode(), entries, names, entsize)
        segments = read(phoff, phentsize * phnum)
    return [_in_file(addresses[symbol], segments, phentsize, phnum) for symbol in symbols]


def _address(wanted: bytes, entries: bytes, names: bytes, entsize: int) -> int | None:
    """The address of the symbol named wanted in a symbol table: the name itself, else the first that starts so (a
    prefix names a function of several overloads; a whole name is not also taken for its ".cold" part)."""
    start = (names.find(b"\0" + wanted + b"\0") + 1) or (names.find(b"\0" + wanted) + 1)  # 0: none
    at = entries.find(struct.pack("<I", start)) if start else -1
    while at >= 0 and at % entsize:  # the name's offset found inside another field: look on
        at = entries.find(struct.pack("<I", start), at + 1)
    return struct.unpack_from("<IBBHQQ", entries, at)[4] if at >= 0 else None


def _in_file(address: int | None, segments: bytes, phentsize: int, phnum: int) -> int | None:
    """Where a loaded address is in the library's file: in the PT_LOAD segment that holds it."""
    for i in range(phnum if address is not None else 0):
        kind, _, offset, vaddr, _, _, memsz, _ = struct.unpack_from("<IIQQQQQQ", segments, i * phentsize)
        if kind == 1 and vaddr <= address < vaddr + memsz:
            return address - vaddr + offset
    return None


def _naming(field: str, paths: tuple) -> str:
    """The filter that keeps a system call whose path (its field) holds one of paths, or is _LONG bytes or more."""
    return " || ".join([*(f'{field}.ustring ~ "*{p}*"' for p in paths), f'{field}.ustring ~ "{"?" * _LONG}*"'])


def _tracing() -> str | None:
    """The kernel's tracing folder, mounted if it is not and this process may (root); None where there is none.
    A probe made through it (uprobe_events) is a tracepoint, which a perf event inherits into the threads and
    processes its task starts; the uprobe PMU's events cannot be inherited into another process's children
    (the kernel reads the probed file's path from the starting process's memory, and the fork fails)."""
    for folder in _TRACING:
        if os.path.exists(f"{folder}/uprobe_events"):
            return folder
    if os.geteuid() == 0 and os.path.isdir(_TRACING[0]):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mount(b"nodev", _TRACING[0].encode(), b"tracefs", 0, None) == 0:
            return _TRACING[0]
    return None


_probes: dict | None = None


def _defined(folder: str, path: str, offset: int) -> int | None:
    """The tracepoint id of a uprobe at path:offset, defined once for the machine (its name says which file and
    offset, so graders of other torch installs never share one, and those of this one do, none removing it)."""
    event = f"f{os.stat(path).st_ino:x}_{offset:x}"
    id_file = f"{folder}/events/course/{event}/id"
    if not os.path.exists(id_file):
        try:
            fd = os.open(f"{folder}/uprobe_events", os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, f"p:course/{event} {path}:0x{offset:x}\n".encode())
            finally:
                os.close(fd)
        except OSError:  # refused, or made meanwhile by another grader
            pass
    return _tracepoint(id_file)


def _tracepoint(id_file: str) -> int | None:
    """The id of a tracepoint, from its id file in the tracing folder; None where it has none."""
    try:
        with open(id_file) as f:
            return int(f.read())
    except OSError:
        return None


def _resolved() -> dict:
    """name -> (tracepoint id, filter or None) of each entry's functions that this torch has (a version without
    one, gloo's alltoall in torch 2.11, leaves it to the base class, which refuses the call), or of each system call
    that names a path, filtered to the entry's paths; made once: the libraries are large."""
    global _probes
    if _probes is None:
        import torch

        lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        folder, _probes = _tracing(), {}
        for name, entry in ENTRIES.items():
            if folder is None:
                break
            if entry.paths:
                found = [(_tracepoint(f"{folder}/events/syscalls/{event}/id"), field) for event, field in _NAMING]
                if all(i is not None for i, _ in found):
                    _probes[name] = tuple((i, _naming(field, entry.paths)) for i, field in found)
                continue
            path = os.path.realpath(os.path.join(lib, entry.library))
            if not os.path.exists(path):
                continue
            offsets = _file_offsets(path, entry.symbols)
            ids = [_defined(folder, path, offset) for offset in offsets if offset is not None]
            if ids and None not in ids:
                _probes[name] = tuple((i, None) for i in ids)
    return _probes


def held(entry: Entry) -> set:
    """The modules of entry's files that this process holds, of those it names (a package's: importing any module
    of it imports the package first): a rank forked from it uses them without opening a file."""
    return {name for name in entry.modules if name in sys.modules}


# An event's descriptor is moved to this number or above: a grader holds hundreds (one per thread and function),
# which would push the descriptors of its pipes and sockets past what select() takes (FD_SETSIZE).
_HIGH = 4096


def _high_enough() -> bool:
    """Whether this process may hold descriptors from _HIGH up (the soft limit raised to the hard one if need be)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = _HIGH + 8192
    if soft != resource.RLIM_INFINITY and soft < wanted:
        top = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if top <= _HIGH:
            return False
        resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
    return True


def _open(tid: int, tracepoint: int, kept: str | None = None, inherit: bool = True) -> int:
    """A counting event on one thread, inherited by the threads and processes it starts (unless not inherit), of the
    tracepoint's events that the filter `kept` keeps (inherited too); its descriptor at _HIGH or above where the limit
    allows; -errno if refused."""
    attr = _Attr(type=_TRACEPOINT, size=ctypes.sizeof(_Attr), config=tracepoint, flags=_INHERIT if inherit else 0)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(_PERF_EVENT_OPEN, ctypes.byref(attr), tid, -1, -1, _FD_CLOEXEC)
    if fd < 0:
        return -ctypes.get_errno()
    if kept is not None and libc.ioctl(fd, _SET_FILTER, ctypes.c_char_p(kept.encode())) != 0:
        error = ctypes.get_errno()
        os.close(fd)
        return -error
    try:
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _HIGH) if _high_enough() else fd
    except OSError:  # the limit reached: it stays where it is
        return fd
    if high != fd:
        os.close(fd)
    return high


def available(names: tuple = ()) -> bool:
    """Whether the kernel counts calls for this process (Counter.attach gives one), of each of names too: for an
    entry of paths, where this process holds none of its modules (a rank forked from it would use it unseen)."""
    if _PERF_EVENT_OPEN is None or not _resolved() or not set(names) <= set(_resolved()):
        return False
    return not any(held(ENTRIES[name]) for name in names) and _permitted()


@functools.cache
def _permitted() -> bool:
    """Whether the kernel lets this process open a counting event (asked once)."""
    return _held_open(next(iter(_resolved().values()))[0][0])


# The kernel takes a probe away when the last event on it closes, and waits for that on every CPU: a tenth of a second
# or more for each of a world's functions, seconds under load, at the end of every world counted. So this process
# holds an event of its own on each probe it counts with, from the first world on, for as long as it lives (its
# own calls, never read; not inherited by the worlds it forks): a world's events then close at no cost.
_holding: dict = {}  # tracepoint id -> the descriptor of this process's event on it


def _held_open(tracepoint: int) -> bool:
    """Whether this process holds an event on the tracepoint (opened now if need be; False where refused)."""
    if tracepoint not in _holding:
        fd = _open(os.getpid(), tracepoint, inherit=False)
        if fd < 0:
            return False
        _holding[tracepoint] = fd
    return True


def _tasks(pid: int) -> set:
    try:
        return {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    except OSError:
        return set()


class Counter:
    """The kernel's count of entries' calls in the processes of each rank of one world."""

    def __init__(self, rank_pids: list):
        self.rank_pids = rank_pids
        self.fds: dict = {}  # (rank, name) -> the events of that rank's threads
        self.names: set = set()  # the entries counted

    @classmethod
    def attach(cls, rank_pids: list, names: tuple) -> Counter | None:
        """Count names in every thread of each rank's processes, and in what they start from now on. Call it before
        any code under test runs in them. None where the kernel counts no calls for this process."""
        if not available():
            return None
        counter = cls(rank_pids)
        if not counter.count(names):
            counter.close()
            return None
        return counter

    def count(self, names: tuple) -> bool:
        """Count names too, from now on (an entry is counted only where a world's checks forbid it: each costs an
        event per thread); False where the kernel refused one."""
        new = [name for name in names if name in _resolved() and name not in self.names]
        try:
            if not self._follow(new):
                return False
        except OSError:
            return False
        self.names.update(new)
        return True

    def _follow(self, names: list) -> bool:
        """Open the events of names on every thread, until a look finds none new (a thread started while the events
        were opened is looked for again: the events of the threads followed are inherited by what they start, not
        by what they started before). False where the kernel refused one."""
        if not all(_held_open(tracepoint) for name in names for tracepoint, _ in _resolved()[name]):
            return False
        followed: set = set()
        while names:
            parents = processes()  # one look at the machine's processes for every rank
            new = [
                (rank, tid)
                for rank, pid in enumerate(self.rank_pids)
                for process in [pid, *descendants([pid], parents)]
                for tid in _tasks(process)
                if tid not in followed
            ]
            if not new:
                return True
            for rank, tid in new:
                followed.add(tid)
                for name in names:
                    for tracepoint, kept in _resolved()[name]:
                        fd = _open(tid, tracepoint, kept)
                        if fd == -3:  # ESRCH: the thread ended since it was listed
                            break
                        if fd < 0:
                            return False
                        self.fds.setdefault((rank, name), []).append(fd)
        return True

    def counts(self) -> dict:
        """(rank, name) -> calls counted so far, in the threads followed and in every process or thread they
        started that has ended (the kernel adds an inherited event's count to its parent's when it ends)."""
        return {key: sum(struct.unpack("<Q", os.read(fd, 8))[0] for fd in fds) for key, fds in self.fds.items()}

    def close(self) -> None:
        for fds in self.fds.values():
            for fd in fds:
                os.close(fd)
        self.fds = {}
