"""What a worker watches in the code it runs, so that failures can be named exactly.

- ``PointToPoint`` notes every send and receive that a rank starts, and whether it was waited for:
  a request never waited for is reported when fn returns (instead of a hang), and a rank stuck in
  a message names its peer. With collectives checked it carries the default group's messages on
  an unchecked twin of it (``unchecked_group``): gloo counts every send and receive in the
  sequence number that torch's check compares before each collective, so ranks that sent
  different numbers of messages (the middle stages of a pipeline send twice as many as the ends)
  were reported as calling different collectives at their next one.
- ``Agreement``: with collectives checked, the ranks compare each collective of the default group
  before they start it, on the unchecked twin: which one, its root (src, dst), its reduce op, and
  its tensor's shape and dtype. torch's check compares neither root nor reduce op, and reports a
  shape or dtype that differs as different collectives. A broadcast whose src differs between ranks
  then fails at once, naming the src, instead of waiting for the collective timeout.
- ``Loops``: where a rank that runs loops, for the parent that stopped its world. One stack cannot
  tell a loop from what it calls again and again: largest_world looping for ever over t_sync_of
  showed as stuck in t_sync_of, or in a check's function that t_sync_of was.
- ``check_ddp_on_an_unchecked_group``: built-in DistributedDataParallel segfaults in its
  constructor on the process group that TORCH_DISTRIBUTED_DEBUG=DETAIL wraps around the default
  one (torch 2.13, CPU, seen here). A group made with the check off works, so DDP gets one, and
  every other collective stays checked.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from course.failure import C10D_FILE, ArgumentsDiffer, is_plumbing, loop_dump

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
        result = self._work.wait(*args, **kwargs)
        self._tracker.waiting = None
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


class PointToPoint:
    """Patches the process group's send and receive for the life of a worker."""

    def __init__(self):
        self.pending: dict = {}  # id of a request not yet waited for -> its entry
        self.waiting: dict | None = None  # the entry of the message a wait() is blocked on
        self.carriers: dict = {}  # a group -> the group that carries its messages instead

    def carry_on(self, group: ProcessGroup, carrier: ProcessGroup) -> None:
        """Send and receive the messages of ``group`` on ``carrier``, a group of the same ranks."""
        self.carriers[group] = carrier

    def install(self) -> None:
        for method in _DIRECTION:
            if method in vars(ProcessGroup):
                setattr(ProcessGroup, method, self._tracked(method, vars(ProcessGroup)[method]))

    def _tracked(self, method: str, original):
        def tracked(group, *args, **kwargs):
            call, frame = _caller(method)
            peer = args[1] if method != "recv_anysource" and len(args) > 1 else None
            carrier = self.carriers.get(group, group)
            request = _Request(original(carrier, *args, **kwargs), self, dict(collective=call, peer=peer, frame=frame))
            self.pending[id(request)] = request._entry
            return request

        return tracked

    def never_waited(self) -> dict | None:
        return next(iter(self.pending.values()), None)


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
    shape = list(tensor.shape) if tensor is not None else []
    dims = shape[:_DIMENSIONS] + [-1] * (_DIMENSIONS - len(shape[:_DIMENSIONS]))
    dtype = _DTYPES.index(tensor.dtype) if tensor is not None else -1
    return [list(_CALLS).index(method), root, op, dtype, len(shape) if tensor is not None else -1, *dims]


class Agreement:
    """Patches the process group's collectives, for the life of a worker, so that the ranks compare
    each collective of ``group`` before they start it, on ``carrier`` (a group of the same ranks)."""

    def install(self, group: ProcessGroup, carrier: ProcessGroup) -> None:
        self.group, self.carrier = group, carrier
        self.allgather = vars(ProcessGroup)["allgather"]  # the original: the exchange is not a collective of the code
        for method in _CALLS:
            if method in vars(ProcessGroup):
                setattr(ProcessGroup, method, self._compared(method, vars(ProcessGroup)[method]))

    def _compared(self, method: str, original):
        def compared(group, *args, **kwargs):
            if group is self.group:
                self._compare(method, args)
            return original(group, *args, **kwargs)

        return compared

    def _compare(self, method: str, args: tuple) -> None:
        mine = torch.tensor(_record(method, args), dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.carrier.size())]
        self.allgather(self.carrier, [every], [mine]).wait()
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


class Loops:
    """Answers the parent's asks for this rank's stack (SIGUSR1, course/workers.py). Each ask dumps
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


_unchecked: dict = {}


def unchecked_group(timeout=None, use: str = "messages") -> ProcessGroup:
    """A group of every rank whose collectives torch's check does not wrap, for one use: made once
    per world, by every rank at the same point (its first call), with the collective timeout
    ``timeout``. "messages": the default group's sends and receives, and DDP's collectives;
    "agreement": Agreement's exchanges, which must not interleave with DDP's (Join's included);
    "torch": torch's own DTensor code in the checks' probes (course/compat.py, cpu_mesh)."""
    if use not in _unchecked:
        level = dist.get_debug_level()
        dist.set_debug_level(dist.DebugLevel.OFF)
        _unchecked[use] = dist.new_group(timeout=timeout)
        dist.set_debug_level(level)
    return _unchecked[use]


def check_ddp_on_an_unchecked_group() -> None:
    ddp = torch.nn.parallel.DistributedDataParallel
    original = ddp.__init__

    def __init__(self, module, *args, **kwargs):
        if len(args) < 6 and kwargs.get("process_group") is None:  # process_group is the 7th parameter
            kwargs["process_group"] = unchecked_group()
        original(self, module, *args, **kwargs)

    ddp.__init__ = __init__
