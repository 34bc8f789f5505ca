"""What a worker watches in the code it runs, so that failures can be named exactly.

- ``PointToPoint`` notes every send and receive that a rank starts, and whether it was waited for
  (and refuses one with a peer outside its group, which gloo leaves to hang or crash):
  a request never waited for is reported when fn returns (instead of a hang), and a rank stuck in
  a message names its peer.
- ``Agreement``: with collectives checked (gloo), the ranks compare each collective before they start
  it, on a twin of its group that carries nothing else: which one, its root (src, dst), its reduce
  op, and its tensor's shape and dtype. Ranks that call different collectives, or the same one with
  a different src, op, shape or dtype, fail at once, each named with its own, instead of waiting
  for the collective timeout (or gloo pairing them and giving wrong numbers). It replaced torch's
  own check (TORCH_DISTRIBUTED_DEBUG=DETAIL), which compared no root or reduce op, cost a monitored
  barrier and two all-gathers per collective (a sixth of a whole grade), counted messages as
  collectives (a pipeline's middle stages send twice as many as its ends) and crashed built-in DDP.
- ``Waits``: what the rank's main thread is blocked in now (a send, a receive, a collective, a group being
  made, a key of the store) and what it has started that a peer may wait for, on its ``Board``, which the
  parent reads at any moment: a world whose every rank waits for what no peer will ever do is reported at
  once (course/runtime/failure.py's ``deadlock``), not at the collective timeout or the world's limit.
- ``Loops``: where a rank that runs loops, for the parent that stopped its world. One stack cannot
  tell a loop from what it calls again and again: largest_world looping for ever over t_sync_of
  showed as stuck in t_sync_of, or in a check's function that t_sync_of was.
"""

from __future__ import annotations

import ast
import contextlib
import faulthandler
import functools
import inspect
import mmap
import os
import signal
import struct
import sys
import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch.distributed import ProcessGroup
from torch.multiprocessing.reductions import StorageWeakRef

from course.runtime.failure import C10D_FILE, ArgumentsDiffer, is_plumbing, is_student_file, loop_dump

_DIRECTION = {"send": ("send", "isend"), "recv": ("recv", "irecv"), "recv_anysource": ("recv", "irecv")}


def _caller(method: str) -> tuple:
    """(torch.distributed function, the student's frame) of a process group method's call."""
    blocking, started = _DIRECTION[method]
    call, frame = started, sys._getframe(2)
    while frame is not None and is_plumbing(frame.f_code.co_filename):
        if frame.f_code.co_filename.endswith(C10D_FILE) and frame.f_code.co_name == blocking:
            call = blocking
        frame = frame.f_back
    where = (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name) if frame else ("", 0, "")
    return call, where


class _Request:
    """A started message's handle that tells its tracker when someone waits for it."""

    def __init__(self, work, tracker: PointToPoint, entry: dict):
        self._work, self._tracker, self._entry = work, tracker, entry

    def wait(self, *args, **kwargs):
        self._tracker.pending.pop(id(self), None)
        self._tracker.waiting = self._entry
        waits = self._tracker.waits
        with waits.waiting(*_message_record(waits, self._entry)) if waits else contextlib.nullcontext():
            result = self._work.wait(*args, **kwargs)
        self._tracker.waiting = None
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)

    def __del__(self):
        # gloo drops a message whose handle is freed before it ends: its peer then waits for ever, and
        # the deadlock is this rank's not waiting, not the order of the messages.
        entry = self._tracker.pending.pop(id(self), None)
        if entry is not None:
            entry["dropped"] = not self._work.is_completed()
            self._tracker.pending[object()] = entry  # still never waited for; its id may be reused now


class PointToPoint:
    """Patches the process group's send and receive for the life of a worker."""

    def __init__(self):
        self.pending: dict = {}  # id of a request not yet waited for -> its entry
        self.waiting: dict | None = None  # the entry of the message a wait() is blocked on
        self.waits: Waits | None = None  # told of each wait()
        # (group, "send" or "recv", peer's world rank (None: any), tag) -> how many such messages were started
        self.started: dict = {}

    def clear(self) -> None:
        """At each call: nothing started yet."""
        self.pending.clear()
        self.waiting = None
        self.started.clear()

    def install(self) -> None:
        for method in _DIRECTION:
            if method in vars(ProcessGroup):
                setattr(ProcessGroup, method, self._tracked(method, vars(ProcessGroup)[method]))

    def _tracked(self, method: str, original):
        def tracked(group, *args, **kwargs):
            call, frame = _caller(method)
            peer = args[1] if method != "recv_anysource" and len(args) > 1 else None
            if isinstance(peer, int) and not 0 <= peer < group.size():
                # gloo does not check: such a message waited for ever, or crashed the rank (torch 2.13).
                raise ValueError(
                    f"dist.{call} with rank {peer}: its group has {group.size()} rank{'s' * (group.size() != 1)},"
                    f" 0 to {group.size() - 1}"
                )
            direction = _DIRECTION[method][0]
            entry = dict(collective=call, peer=peer, frame=frame, direction=direction)
            known = _group_of(group)
            if known is not None:  # for the waits board: peers by their rank in the world
                to = known[1][peer] if peer is not None and peer < len(known[1]) else None
                place = 1 if method == "recv_anysource" else 2  # of the tag, among the method's arguments
                tag = args[place] if len(args) > place else kwargs.get("tag", 0)
                key = (known[0], direction, to, tag)
                number = self.started[key] = self.started.get(key, 0) + 1
                # gloo pairs two ranks' messages of a group and tag in the order each rank starts them; a receive from
                # any rank started before may take a peer's message out of that order.
                exact = not self.started.get((known[0], "recv", None, tag))
                entry.update(group=known[0], to=to, tag=tag, number=number, exact=exact)
            request = _Request(original(group, *args, **kwargs), self, entry)
            self.pending[id(request)] = request._entry
            return request

        return tracked

    def never_waited(self) -> dict | None:
        return next(iter(self.pending.values()), None)

    def dropped(self) -> list:
        """[torch.distributed function, peer, [file, line, function]] of the first message freed unfinished
        and never waited for; [] where there is none."""
        entry = next((e for e in self.pending.values() if e.get("dropped")), None)
        return [entry["collective"], entry["peer"], list(entry["frame"])] if entry else []

    def offers(self) -> list:
        """[group, "send" or "recv", peer's world rank (None: any), tag, its number among those] of each message
        started and not yet waited for to its end, nor freed before (gloo dropped it). One may have ended already
        unwaited: a peer waiting for it may then be wrongly thought able to end, never the reverse."""
        entries = [*self.pending.values(), *([self.waiting] if self.waiting else [])]
        return [
            [e["group"], e["direction"], e["to"], e["tag"], e["number"]]
            for e in entries
            if "group" in e and not e.get("dropped")
        ]


def _message_record(waits: Waits, entry: dict) -> tuple:
    """(record, literal) of a message's wait, for the waits board; (None, "") where its group is not known."""
    if "group" not in entry:
        return None, ""
    frames = [list(entry["frame"])] if entry["frame"][0] else []
    facts = {k: entry[k] for k in ("group", "direction", "to", "tag", "number", "exact")}
    return waits.record("message", entry["collective"], frames, peer=entry["peer"], **facts)


_groups: dict = {}


def _group_of(group: ProcessGroup) -> tuple | None:
    """(its name, the world ranks of its members) of a group, the same on every rank; None for a group
    that torch.distributed does not know (a backend's own)."""
    if group not in _groups:
        try:
            _groups[group] = (group.group_name, dist.get_process_group_ranks(group))
        except (KeyError, RuntimeError, ValueError):
            _groups[group] = None
    return _groups[group]


# The process group's collective methods, each with torch's name for it (its OpType) and the
# argument holding tensors of the same shape on every rank.
_CALLS = {
    "allreduce": ("ALLREDUCE", 0),
    "allreduce_coalesced": ("ALLREDUCE_COALESCED", 0),
    "allgather": ("ALLGATHER", 1),
    "_allgather_base": ("_ALLGATHER_BASE", 0),
    "allgather_coalesced": ("ALLGATHER_COALESCED", 1),
    "allgather_into_tensor_coalesced": ("ALLGATHER_INTO_TENSOR_COALESCED", 0),
    "reduce_scatter": ("REDUCE_SCATTER", 0),
    "_reduce_scatter_base": ("_REDUCE_SCATTER_BASE", 0),
    "reduce_scatter_tensor_coalesced": ("REDUCE_SCATTER_TENSOR_COALESCED", 0),
    "broadcast": ("BROADCAST", 0),
    "reduce": ("REDUCE", 0),
    "gather": ("GATHER", 1),
    "scatter": ("SCATTER", 0),
    "alltoall": ("ALLTOALL", 0),
    "alltoall_base": ("ALLTOALL_BASE", 0),
    "barrier": ("BARRIER", None),
}
# Those whose tensors may differ in shape from rank to rank: an all-to-all's blocks are of any size (torch 2.11's
# dist.all_to_all_single with split sizes reaches alltoall_base; 2.13's, a method of its own): only their dtype is
# compared.
_ANY_SHAPE = ("alltoall", "alltoall_base")
# torch's functional collectives (torch.distributed._functional_collectives), each with the process group method
# that its op calls: from C++, never through the methods above. Each starts its collective and returns at once; the
# rank blocks in wait_tensor, at the result's first use. Named as the boards name the method's own collective: a
# functional all_reduce and dist.all_reduce meet in gloo. Those that another torch lacks are not watched; an alias
# that calls another of them (2.13's all_gather_tensor calls all_gather_single) is seen as one collective.
FUNCTIONAL = {
    "broadcast": "broadcast",
    "all_reduce": "allreduce",
    "all_reduce_coalesced": "allreduce_coalesced",
    **dict.fromkeys(
        ("all_gather_single", "all_gather_single_autograd", "all_gather_tensor", "all_gather_tensor_autograd"),
        "_allgather_base",
    ),
    **dict.fromkeys(
        (
            "reduce_scatter_single",
            "reduce_scatter_single_autograd",
            "reduce_scatter_tensor",
            "reduce_scatter_tensor_autograd",
        ),
        "_reduce_scatter_base",
    ),
    **dict.fromkeys(
        ("all_gather_single_coalesced", "all_gather_into_tensor_coalesced"), "allgather_into_tensor_coalesced"
    ),
    **dict.fromkeys(
        ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"), "reduce_scatter_tensor_coalesced"
    ),
    **dict.fromkeys(("all_to_all_single", "all_to_all_single_autograd"), "alltoall_base"),
}
_FUNCTIONAL_FILE = os.path.basename(funcol.__file__)
_REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
_DIMENSIONS = 4  # of a shape compared (a tensor of more compares its first four and its size)
# Every dtype of torch, in an order that every rank shares: a collective's dtype travels as its index.
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        return next((t for t in map(_first_tensor, value) if t is not None), None)
    return None


def _record(method: str, args: tuple) -> list:
    """[which call, its root or -1, its reduce op or -1, its dtype or -1, dimensions, shape...]: what the
    ranks compare."""
    _, tensors = _CALLS[method]
    options = next((a for a in args if type(a).__name__.endswith("Options")), None)
    root = getattr(options, "rootRank", -1)
    op = getattr(options, "reduceOp", None)
    op = next((i for i, name in enumerate(_REDUCE_OPS) if op == getattr(dist.ReduceOp, name)), -1)
    tensor = _first_tensor(args[tensors]) if tensors is not None and len(args) > tensors else None
    shaped = tensor is not None and method not in _ANY_SHAPE
    shape = list(tensor.shape) if shaped else []
    dims = shape[:_DIMENSIONS] + [-1] * (_DIMENSIONS - len(shape[:_DIMENSIONS]))
    dtype = _DTYPES.index(tensor.dtype) if tensor is not None else -1
    return [list(_CALLS).index(method), root, op, dtype, len(shape) if shaped else -1, *dims]


class Agreement:
    """Patches the process group's collectives, for the life of a worker, so that the ranks compare each
    collective of a group before they start it, on the group's twin: a group of the same ranks, made with
    it, that carries nothing else. The default group's twin is made at install; every group made later
    (dist.new_group, and what calls it: new_subgroups, a DeviceMesh) gets its own as it is made, by the same
    ranks in the same order. A group made unchecked (a group_desc that starts with UNCHECKED) has none."""

    def install(self, timeout: timedelta) -> None:
        self.carriers = {dist.group.WORLD: unchecked_group("agreement", timeout)}
        # As Waits sees it: a wait of the rank, not a collective of the code.
        self.allgather = vars(ProcessGroup)["allgather"]
        for method in _CALLS:
            if method in vars(ProcessGroup):
                setattr(ProcessGroup, method, self._compared(method, vars(ProcessGroup)[method]))
        made, carriers = c10d._new_group_with_tag, self.carriers

        def _new_group_with_tag(*args, **kwargs):
            # The twin takes the same ranks: a list, where torch takes any iterable (a generator is read once).
            if args and args[0] is not None:
                args = (list(args[0]), *args[1:])
            elif kwargs.get("ranks") is not None:
                kwargs["ranks"] = list(kwargs["ranks"])
            group = made(*args, **kwargs)
            if not str(kwargs.get("group_desc") or "").startswith(UNCHECKED):
                twin = made(*args, **dict(kwargs, group_desc=TWIN))
                if isinstance(group, ProcessGroup):  # not a member: GroupMember.NON_GROUP_MEMBER
                    carriers[group] = twin
            return group

        c10d._new_group_with_tag = _new_group_with_tag

    def _compared(self, method: str, original):
        def compared(group, *args, **kwargs):
            carrier = self.carriers.get(group)
            if carrier is not None:
                self._compare(carrier, method, args)
            return original(group, *args, **kwargs)

        return compared

    def _compare(self, carrier: ProcessGroup, method: str, args: tuple) -> None:
        mine = torch.tensor(_record(method, args), dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(carrier.size())]
        self.allgather(carrier, [every], [mine]).wait()
        records = [r.tolist() for r in every]
        if any(r != records[0] for r in records):
            names = list(_CALLS)
            raise ArgumentsDiffer(
                calls=[_CALLS[names[r[0]]][0] for r in records],
                roots=[r[1] if r[1] >= 0 else None for r in records],
                ops=[_REDUCE_OPS[r[2]] if r[2] >= 0 else "" for r in records],
                dtypes=[str(_DTYPES[r[3]]).removeprefix("torch.") if r[3] >= 0 else None for r in records],
                shapes=[r[5 : 5 + min(r[4], _DIMENSIONS)] if r[4] >= 0 else None for r in records],
            )


_BOARD_BYTES = 1 << 16
_HEAD = struct.Struct("<QI")  # the board's generation (odd while it is written), the length of what it says


class Board:
    """A rank's waits board: a file in the grader's folder for the world, mapped into the rank, that its parent reads at any
    moment without asking the rank (a rank blocked in C answers no signal in Python). It says a Python
    literal: (the wait's record, collectives started by group, messages offered, groups made), or nothing."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, _BOARD_BYTES)
        self.map = mmap.mmap(fd, _BOARD_BYTES)
        os.close(fd)
        self.generation = 0

    def write(self, said: bytes) -> None:
        if len(said) > _BOARD_BYTES - _HEAD.size:
            said = b""  # too much to say: nothing, so the parent thinks the rank may still move
        self.generation += 1
        _HEAD.pack_into(self.map, 0, self.generation, 0)
        self.map[_HEAD.size : _HEAD.size + len(said)] = said
        self.generation += 1
        _HEAD.pack_into(self.map, 0, self.generation, len(said))


def read_board(path: str) -> tuple | None:
    """(generation, the wait's record with "started", "offers" and "made", or None) of a rank's board; None while
    it is written, or where there is none. Read as a literal: the rank runs code that is not trusted."""
    try:
        with open(path, "rb") as f:
            data = f.read(_BOARD_BYTES)
            f.seek(0)
            again = f.read(_HEAD.size)
    except OSError:
        return None
    if len(data) < _HEAD.size or again != data[: _HEAD.size]:
        return None
    generation, length = _HEAD.unpack_from(data)
    if generation % 2:
        return None
    if not length:
        return generation, None
    try:
        record, started, offers, made = ast.literal_eval(data[_HEAD.size : _HEAD.size + length].decode())
        return generation, dict(record, started=started, offers=offers, made=made)
    except Exception:  # noqa: BLE001 - whatever a rank wrote there: it says nothing
        return None


def _called_from(depth: int, outermost) -> tuple:
    """(the torch.distributed function the code called, its frames, outermost first: the innermost that is not
    plumbing, and the innermost in a student file above it where that one is not (a check's wrapper that the
    student's code called: failure's _own picks the student's); [] where the launcher called it).
    ``outermost``: the worker's own frame; those above it are its parent's, copied by fork."""
    frame, call = sys._getframe(depth), ""
    while frame is not None and frame is not outermost and is_plumbing(frame.f_code.co_filename):
        if frame.f_code.co_filename.endswith((C10D_FILE, _FUNCTIONAL_FILE)):
            call = frame.f_code.co_name  # the outermost: broadcast_object_list, not the broadcast it calls
        frame = frame.f_back
    if frame is None or frame is outermost:  # the launcher's barrier after the function returned
        return "", []
    frames = [[frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name]]
    student = frame
    while student is not None and student is not outermost and not is_student_file(student.f_code.co_filename):
        student = student.f_back
    if student is not None and student is not outermost and student is not frame:
        frames.insert(0, [student.f_code.co_filename, student.f_lineno, student.f_code.co_name])
    return call, frames


class Waits:
    """Says on the rank's board what its main thread is blocked in: a message's wait() (told by
    PointToPoint), or a collective of a group torch.distributed knows, from its call (under the collective
    check, the ranks compare it there first) to the end of its Work's wait(); or, in the store, a group
    being made (gloo connects its members there, in C++) and the store's barrier after it
    (TORCH_DIST_INIT_BARRIER), or a key of the store waited for from Python (Store.wait, get, multi_get).
    A functional collective (torch.distributed._functional_collectives) is a collective too, from its call to
    the end of the first wait_tensor on its result.
    With it, what the rank has started that a peer may wait for: messages (PointToPoint.offers), by
    group how many collectives, and the groups it has made, each by torch's name for it.
    A record is a report as failure.rank_report makes one, so the parent words a deadlock as any other."""

    def __init__(self, rank: int, board: Board, messages: PointToPoint):
        self.rank, self.board, self.messages = rank, board, messages
        messages.waits = self
        self.stack: list = []  # (record, its literal) of the waits the rank is in, innermost last
        self.started: dict = {}  # a group's name -> how many collectives the rank started on it
        self.works = weakref.WeakKeyDictionary()  # a started collective's Work -> (record, its literal)
        # Of each functional collective whose result is not waited for yet: (weak references to its results' storages,
        # by which torch finds its Work, a view's too), (record, its literal)).
        self.in_flight: list = []
        self.functional = False  # in a functional collective's call: one that it calls (an alias's) is its own
        self.broken: dict | None = None  # the record of the first wait of this call that raised
        # A group's name -> [this rank's place in it, -1 where it is no member; its size]: of every group made
        # since the world's own, and as its literal (said with every wait, changed only when a group is made).
        self.made: dict = {}
        self.made_literal = "{}"
        self.world = 0  # the size of the world, from its group's making
        self.groups = 0  # how many groups the code has made in this call, the course's own not counted
        self.making: tuple = ()  # (name, ranks, number) of the last group made: for the store's barrier after it

    def install(self) -> None:
        """Called by the worker's own function, the outermost of the rank's frames."""
        self.outermost = sys._getframe(1)
        for method in _CALLS:
            if method in vars(ProcessGroup):
                setattr(ProcessGroup, method, self._watched(method, vars(ProcessGroup)[method]))
        original, works, waiting = dist.Work.wait, self.works, self.waiting

        def wait(work, *args, **kwargs):
            said = works.pop(work, None)
            if said is None:
                return original(work, *args, **kwargs)
            with waiting(*said):
                return original(work, *args, **kwargs)

        dist.Work.wait = wait
        # Looked up in the module at each call, by torch's code (DTensor's) as by the student's.
        for name in FUNCTIONAL:
            if name in vars(funcol):
                setattr(funcol, name, self._functional(name, vars(funcol)[name]))
        funcol.wait_tensor = self._wait_tensor(funcol.wait_tensor)
        # Looked up in torch.distributed's module at each call: by new_group (and what calls it) and
        # init_process_group alike.
        c10d._new_process_group_helper = self._making(c10d._new_process_group_helper)
        c10d._store_based_barrier = self._barrier(c10d._store_based_barrier)
        for method in _STORE_WAITS:
            if method in vars(dist.Store):
                setattr(dist.Store, method, self._store_wait(method, vars(dist.Store)[method]))

    def clear(self) -> None:
        """At each call: nothing waited yet."""
        self.stack.clear()
        self.in_flight.clear()
        self.broken = None
        self.groups = 0
        self._say()

    def _making(self, original):
        signature = inspect.signature(original)

        def making(*args, **kwargs):
            given = signature.bind(*args, **kwargs).arguments
            name, ranks, place = given["group_name"], list(given["global_ranks_in_group"]), given["group_rank"]
            if not ranks:  # the world's group: a new world, whose groups torch names from 0 again
                self.world, self.made = given["group_size"], {}
                ranks = list(range(self.world))
            desc = str(given.get("group_desc") or "")
            if given["global_ranks_in_group"] and not desc.startswith(UNCHECKED):
                self.groups += 1
            # A twin is made in the code's new_group call: it is the code's group to the student.
            number = self.groups if desc == TWIN or not desc.startswith(UNCHECKED) else 0
            self.made[name] = [place if place is not None else -1, len(ranks)]
            self.made_literal = repr(self.made)
            self.making = (name, ranks, number)
            if place is None:  # no member: torch returns at once
                return original(*args, **kwargs)
            call, frames = _called_from(2, self.outermost)
            said = self.record("group", call, frames, group=name, ranks=ranks, number=number, phase="connect")
            with self.waiting(*said):
                return original(*args, **kwargs)

        return making

    def _barrier(self, original):
        signature = inspect.signature(original)

        def barrier(*args, **kwargs):
            given = signature.bind(*args, **kwargs).arguments
            name, ranks, number = self.making
            if name != given["group_name"]:  # not after a group made here: nothing known to judge it by
                return original(*args, **kwargs)
            # Counted in the world's store by the whole world, or by the members (use_local_synchronization).
            within = list(range(self.world)) if given["rendezvous_count"] == self.world else ranks
            call, frames = _called_from(2, self.outermost)
            said = self.record(
                "group", call, frames, group=name, ranks=ranks, number=number, phase="barrier", within=within
            )
            with self.waiting(*said):
                return original(*args, **kwargs)

        return barrier

    def _store_wait(self, method: str, original):
        def waited(store, *args, **kwargs):
            # Inside a wait said already (the store's barrier after a group is made), or no key given.
            if self.stack or not args:
                return original(store, *args, **kwargs)
            keys = [args[0]] if method == "get" else list(args[0])
            call, frames = _called_from(2, self.outermost)
            said = self.record("key", call or f"store.{method}", frames, keys=[str(k) for k in keys])
            with self.waiting(*said):
                return original(store, *args, **kwargs)

        return waited

    def record(self, kind: str, collective: str, frames: list, **facts) -> tuple:
        """(record, its literal) of a wait that begins now."""
        record = dict(
            kind=kind, rank=self.rank, state="waited", when=time.time(), collective=collective, frames=frames, **facts
        )
        dropped = self.messages.dropped()
        if dropped:
            record["dropped"] = dropped
        return record, repr(record)

    def _watched(self, method: str, original):
        def watched(group, *args, **kwargs):
            known = _group_of(group)
            if known is None:
                return original(group, *args, **kwargs)
            name, members = known
            self.started[name] = self.started.get(name, 0) + 1
            call, frames = _called_from(2, self.outermost)
            options = next((a for a in args if type(a).__name__.endswith("Options")), None)
            said = self.record(
                "collective",
                call,
                frames,
                group=name,
                members=members,
                seq=self.started[name],
                call=method,
                root=getattr(options, "rootRank", -1),  # a broadcast from a src of its own on each rank hangs
            )
            with self.waiting(*said):
                work = original(group, *args, **kwargs)
            if work is not None:
                self.works[work] = said
            return work

        return watched

    def _functional(self, name: str, original):
        parameters = list(inspect.signature(original).parameters)

        @functools.wraps(original)  # its signature, for a log that wraps it again (checks/comm_log.py)
        def started(*args, **kwargs):
            if self.functional:
                return original(*args, **kwargs)
            given = {**dict(zip(parameters, args)), **kwargs}
            known = functional_group(given.get("group"), given.get("tag", ""))
            if known is None:
                return original(*args, **kwargs)
            group, members = known
            self.started[group] = self.started.get(group, 0) + 1
            call, frames = _called_from(2, self.outermost)
            said = self.record(
                "collective",
                call or name,
                frames,
                group=group,
                members=members,
                seq=self.started[group],
                call=FUNCTIONAL[name],
                root=given.get("src", -1),
            )
            self.functional = True
            try:
                with self.waiting(*said):
                    result = original(*args, **kwargs)
            finally:
                self.functional = False
            results = result if isinstance(result, list) else [result]
            pending = [r for r in results if isinstance(r, funcol.AsyncCollectiveTensor) and not r.completed]
            if pending:
                self.in_flight.append(([StorageWeakRef(r.elem.untyped_storage()) for r in pending], said))
            return result

        return started

    def _wait_tensor(self, original):
        def wait_tensor(tensor):
            said = self._collective_of(tensor) if self.in_flight and type(tensor) is torch.Tensor else None
            if said is None:  # not a result of a collective seen here (a backward's, which torch starts by its op)
                return original(tensor)
            with self.waiting(*said):
                return original(tensor)

        return wait_tensor

    def _collective_of(self, tensor) -> tuple | None:
        """(record, literal) of the functional collective whose result ``tensor`` is, or a view of, not waited for
        yet; None where it is none's. Only its first wait waits: torch forgets its Work then."""
        self.in_flight = [(refs, said) for refs, said in self.in_flight if not all(r.expired() for r in refs)]
        storage = StorageWeakRef(tensor.untyped_storage())
        found = next((i for i, (refs, _) in enumerate(self.in_flight) if storage in refs), None)
        return self.in_flight.pop(found)[1] if found is not None else None

    @contextlib.contextmanager
    def waiting(self, record: dict | None, literal: str = ""):
        """While the main thread waits in what record says (None: something the parent cannot judge)."""
        self.stack.append((record, literal))
        self._say()
        try:
            yield
        except BaseException:
            self.broken = self.broken or record
            raise
        finally:
            self.stack.pop()
            self._say()

    def _say(self) -> None:
        record, literal = self.stack[-1] if self.stack else (None, "")
        # Another Python thread may yet send what this one waits for: the parent must not judge it.
        if record is None or threading.active_count() > 1:
            self.board.write(b"")
        else:
            said = f"({literal}, {self.started!r}, {self.messages.offers()!r}, {self.made_literal})"
            self.board.write(said.encode())


def functional_group(group, tag: str) -> tuple | None:
    """_group_of the group that a functional collective is given (a process group, a group's name, a DeviceMesh of
    one dimension, or (mesh, dimension)); None where the collective cannot name it (torch's call then says why),
    and for a list of ranks, which torch deprecates (resolving it twice would warn twice)."""
    if isinstance(group, list):
        return None
    try:
        resolved = (
            group
            if isinstance(group, ProcessGroup)
            else c10d._resolve_process_group(funcol._resolve_group_name(group, tag))
        )
    except (AssertionError, KeyError, RuntimeError, ValueError):
        return None
    return _group_of(resolved)


class Loops:
    """Answers the parent's asks for this rank's stack (SIGUSR1, course/runtime/workers.py). Each ask dumps
    every thread's stack at once (faulthandler, in C: a rank blocked in C answers too), then, at the
    rank's next line of Python, notes the frames running. From the second ask on it also writes those
    of them still running since the ask before (failure.loop_dump): the innermost is where the loop
    is, since a function that the loop calls has returned and been called anew in between."""

    def __init__(self, stack_file):
        self.stack_file = stack_file
        self.held: list = []  # the frames running at the last ask, innermost first

    def install(self) -> None:
        """For each call: code under test may have taken the signal."""
        self.held = []
        faulthandler.unregister(signal.SIGUSR1)
        signal.signal(signal.SIGUSR1, self._asked)
        # chain: faulthandler's dump first, then the handler above.
        faulthandler.register(signal.SIGUSR1, file=self.stack_file, all_threads=True, chain=True)

    def _asked(self, signum, frame) -> None:
        running = []
        while frame is not None:
            running.append(frame)
            frame = frame.f_back
        held = {id(f) for f in self.held}  # held, so alive: no frame made since has one of these ids
        still = [(f.f_code.co_filename, f.f_lineno, f.f_code.co_name) for f in running if id(f) in held]
        if still:
            os.write(self.stack_file.fileno(), loop_dump(still[::-1]).encode("utf-8", "backslashreplace"))
        self.held = running


# What a group's group_desc starts with where its collectives are not compared (Agreement); a twin's.
UNCHECKED = "unchecked"
TWIN = f"{UNCHECKED} twin"
# The store's methods that wait for a key another rank sets.
_STORE_WAITS = ("wait", "get", "multi_get")
_unchecked: dict = {}


def unchecked_group(use: str, timeout=None) -> ProcessGroup:
    """A group of every rank whose collectives Agreement does not compare, for one use: made once per
    world, by every rank at the same point, with the collective timeout ``timeout``.
    "agreement": the default group's twin, which carries Agreement's exchanges; "torch": torch's own
    DTensor code in the checks' probes (course/runtime/compat.py, cpu_mesh); "given": a group handed to code
    under test, which must use it rather than the default group (checks/contracts.py)."""
    if use not in _unchecked:
        _unchecked[use] = dist.new_group(timeout=timeout, group_desc=f"{UNCHECKED} {use}")
    return _unchecked[use]
