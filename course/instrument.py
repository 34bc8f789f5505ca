"""What a worker watches in the code it runs, so that failures can be named exactly.

- ``PointToPoint`` notes every send and receive that a rank starts, and whether it was waited for:
  a request never waited for is reported when fn returns (instead of a hang), and a rank stuck in
  a message names its peer. With collectives checked it carries the default group's messages on
  an unchecked twin of it (``unchecked_group``): gloo counts every send and receive in the
  sequence number that torch's check compares before each collective, so ranks that sent
  different numbers of messages (the middle stages of a pipeline send twice as many as the ends)
  were reported as calling different collectives at their next one.
- ``check_ddp_on_an_unchecked_group``: built-in DistributedDataParallel segfaults in its
  constructor on the process group that TORCH_DISTRIBUTED_DEBUG=DETAIL wraps around the default
  one (torch 2.13, CPU, seen here). A group made with the check off works, so DDP gets one, and
  every other collective stays checked.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from course.failure import C10D_FILE, is_plumbing

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


_unchecked: dict = {}


def unchecked_group(timeout=None) -> ProcessGroup:
    """A group of every rank whose collectives torch's check does not wrap: made once per world, by
    every rank at the same point (its first call), with the collective timeout ``timeout``."""
    if "group" not in _unchecked:
        level = dist.get_debug_level()
        dist.set_debug_level(dist.DebugLevel.OFF)
        _unchecked["group"] = dist.new_group(timeout=timeout)
        dist.set_debug_level(level)
    return _unchecked["group"]


def check_ddp_on_an_unchecked_group() -> None:
    ddp = torch.nn.parallel.DistributedDataParallel
    original = ddp.__init__

    def __init__(self, module, *args, **kwargs):
        if len(args) < 6 and kwargs.get("process_group") is None:  # process_group is the 7th parameter
            kwargs["process_group"] = unchecked_group()
        original(self, module, *args, **kwargs)

    ddp.__init__ = __init__
