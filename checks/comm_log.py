"""What a worker sends and which collectives it starts, in order, and when it waits for them; and
how much arithmetic its matrix products do (ProductFlops, exercise 2's work split).

The checks of exercises 5 to 7 need more than final numbers: that a ring used point-to-point
messages only, and how many bytes it sent; that an all-reduce was still running when the
backward pass produced its last gradient; how many collectives one step started. Every
torch.distributed call, whichever Python function the code under test chose (send, isend,
batch_isend_irecv, all_reduce, ...), ends in a method of the process group object, so CommLog
wraps those methods for the duration of a `with` block, in the worker that uses it. torch's functional
collectives (torch.distributed._functional_collectives: DTensor's, and anyone's who calls them) reach the
process group from C++, past those methods: CommLog wraps their functions too, as the worker's own check of
collectives does (course/runtime/instrument.py's FUNCTIONAL), each logged as its process group method.
"""

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup
from torch.utils._python_dispatch import TorchDispatchMode

from checks.helpers import many, maybe
from course.runtime.compat import collective
from course.runtime.instrument import FUNCTIONAL, functional_group

POINT_TO_POINT = ("send", "recv", "recv_anysource")
COLLECTIVES = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "all_gather_single",  # dist.all_gather_into_tensor from torch 2.13 on (course/runtime/compat.py)
    "_allgather_base",  # and before
    "allgather_coalesced",
    "all_gather_single_coalesced",
    "allgather_into_tensor_coalesced",
    "reduce_scatter",
    "reduce_scatter_single",  # dist.reduce_scatter_tensor from torch 2.13 on
    "_reduce_scatter_base",  # and before
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
)

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all-reduce", "all-gather", "reduce-scatter"
# The collectives that CommLog records (course/runtime/compat.py's names), by what they do.
KINDS = {
    "allreduce": ALL_REDUCE,
    "allreduce_coalesced": ALL_REDUCE,
    "allgather": ALL_GATHER,
    "all_gather_into_tensor": ALL_GATHER,
    "allgather_coalesced": ALL_GATHER,
    "allgather_into_tensor_coalesced": ALL_GATHER,
    "all_gather_single_coalesced": ALL_GATHER,
    "reduce_scatter": REDUCE_SCATTER,
    "reduce_scatter_tensor": REDUCE_SCATTER,
    "reduce_scatter_tensor_coalesced": REDUCE_SCATTER,
    "reduce_scatter_single_coalesced": REDUCE_SCATTER,
}


@dataclass
class Event:
    kind: str  # "start" (a message or collective begins), "wait" (for a started one) or "mark"
    what: str  # the process group method, or a mark's label
    number: int = -1  # which started operation, in order: a wait names the one it waits for
    nbytes: int = 0
    peer: int | None = None  # the other rank of a send or receive
    dtype: str = ""  # of the first tensor sent, as "float32"
    ranks: list | None = None  # the world ranks of the group it went to; None for a group torch does not know
    memory: int = 0  # the address of the first tensor's data (data_ptr)


def _tensors(first_argument) -> list:
    tensors = first_argument if isinstance(first_argument, (list, tuple)) else [first_argument]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def _nbytes(first_argument) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(first_argument))


def _members(group) -> list | None:
    if not isinstance(group, ProcessGroup):  # a functional collective's (a list of ranks, a mesh, a name)
        known = functional_group(group, "")
        return known[1] if known else None
    try:
        return dist.get_process_group_ranks(group)
    except (KeyError, RuntimeError, ValueError):  # a backend's own group, not torch.distributed's
        return None


def _memory(first_argument) -> int:
    tensors = _tensors(first_argument)
    return tensors[0].data_ptr() if tensors else 0


def _dtype(first_argument) -> str:
    tensors = _tensors(first_argument)
    return str(tensors[0].dtype).removeprefix("torch.") if tensors else ""


class _Watched:
    """A started operation's handle that notes in the log when someone waits for it."""

    def __init__(self, work, log, event):
        self._work, self._log, self._event = work, log, event

    def wait(self, *args, **kwargs):
        self._log.events.append(Event("wait", self._event.what, self._event.number))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class CommLog:
    """`with CommLog() as log:` records every operation started in the block, and every wait.

    With waits=False it records what starts only, and hands the caller torch's own handles: code
    that passes a handle on to C++ (Join's, under DDP) needs the handle itself.
    """

    def __init__(self, waits=True):
        self.events = []
        self._saved = {}
        self._waits = waits

    def __enter__(self):
        for name in POINT_TO_POINT + COLLECTIVES:
            # The class's own entry, not getattr's bound form: only it can be put back as it was.
            if name in vars(ProcessGroup):
                self._saved[(ProcessGroup, name)] = vars(ProcessGroup)[name]
                setattr(ProcessGroup, name, self._recording(name, getattr(ProcessGroup, name)))
        # Looked up in the module at each call, by torch's code (DTensor's) as by the code under test.
        self._results = {}  # id of a functional collective's result (its tensor) -> its start, until waited for
        self._functional_call = False  # in one: one that it calls (an alias's) is its own
        for name in [name for name in FUNCTIONAL if name in vars(funcol)] + ["wait_tensor"]:
            self._saved[(funcol, name)] = vars(funcol)[name]
            setattr(funcol, name, self._functional(name, vars(funcol)[name]))
        return self

    def __exit__(self, *exc):
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)

    def _start(self, name, first, peer, group) -> Event:
        event = Event(
            "start",
            collective(name),
            len(self.started()),
            _nbytes(first),
            peer,
            _dtype(first),
            _members(group),
            _memory(first),
        )
        self.events.append(event)
        return event

    def _recording(self, name, method):
        def recorded(group, *args, **kwargs):
            peer = args[1] if name in ("send", "recv") and len(args) > 1 else None
            event = self._start(name, args[0] if args else None, peer, group)
            work = method(group, *args, **kwargs)
            return _Watched(work, self, event) if self._waits else work

        return recorded

    def _functional(self, name, original):
        """A functional collective's function that logs its start, its results' first tensors remembered; or
        wait_tensor, which logs the wait of the collective whose result it is given (the first use of one)."""
        if name == "wait_tensor":

            def waited(tensor):
                event = self._results.pop(id(tensor), None)
                if event is not None and self._waits:
                    self.events.append(Event("wait", event.what, event.number))
                return original(tensor)

            return waited
        parameters = list(inspect.signature(original).parameters)

        def started(*args, **kwargs):
            if self._functional_call:
                return original(*args, **kwargs)
            given = {**dict(zip(parameters, args)), **kwargs}
            event = self._start(FUNCTIONAL[name], args[0] if args else None, None, given.get("group"))
            self._functional_call = True
            try:
                result = original(*args, **kwargs)
            finally:
                self._functional_call = False
            results = result if isinstance(result, list) else [result]
            elems = [r.elem if isinstance(r, funcol.AsyncCollectiveTensor) else r for r in results]
            # Its bytes and memory are its result's, as a process group method's are the tensor it writes into
            event.nbytes, event.memory = _nbytes(elems), _memory(elems)
            for tensor, elem in zip(results, elems):
                if isinstance(tensor, funcol.AsyncCollectiveTensor) and not tensor.completed:
                    self._results[id(elem)] = event
            return result

        return started

    def mark(self, label):
        """Note a moment of the computation (a gradient produced, say) among the messages."""
        self.events.append(Event("mark", label))

    def started(self, until=None):
        return [e for e in self.events[:until] if e.kind == "start"]

    def collectives(self):
        return [e for e in self.started() if e.what not in POINT_TO_POINT]

    def collective_memory(self) -> set:
        """Where the collectives' (first) tensors lie: to tell which tensor one went through."""
        return {e.memory for e in self.collectives()}

    def in_flight(self, until=None):
        """Numbers of the operations started before events[until] and not waited for by then."""
        waited = {e.number for e in self.events[:until] if e.kind == "wait"}
        return [e.number for e in self.started(until) if e.number not in waited]

    def summary(self):
        """Picklable figures for the parent process."""
        sent = [e for e in self.started() if e.what == "send"]
        received = [e for e in self.started() if e.what in ("recv", "recv_anysource")]
        return {
            "collectives": [e.what for e in self.collectives()],
            "collective_dtypes": [e.dtype for e in self.collectives()],
            "collective_bytes": [e.nbytes for e in self.collectives()],
            "collective_groups": [e.ranks for e in self.collectives()],
            "sent_bytes": sum(e.nbytes for e in sent),
            "received_bytes": sum(e.nbytes for e in received),
            "send_peers": sorted({e.peer for e in sent}),
            "receive_peers": sorted({e.peer for e in received}),
            "not_waited": self.in_flight(),
        }


# What summary() gives, as a judge expects it (checks/helpers.py: a worker's reply is validated).
SUMMARY = {
    "collectives": many(str),
    "collective_dtypes": many(object),
    "collective_bytes": many(int),
    "collective_groups": many(maybe(many(int))),
    "sent_bytes": int,
    "received_bytes": int,
    "send_peers": many(int),
    "receive_peers": many(int),
    "not_waited": many(int),
}

_aten = torch.ops.aten


class ProductFlops(TorchDispatchMode):
    """The floating-point operations of the matrix and vector products run under it, 2 per
    multiply-add, whatever function or operator called them (they all reach these aten ops).
    torch's FlopCounterMode counts the same for matrices, but its first use imports sympy and
    torch._dynamo: 3 s in each rank of a new world."""

    @classmethod
    def _should_skip_dynamo(cls):
        # Otherwise torch wraps __torch_dispatch__ in torch._disable_dynamo, whose first call
        # imports torch._dynamo (1.2 s a rank); nothing here is compiled.
        return False

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in (_aten.mm, _aten.bmm, _aten.mv, _aten.dot):
            a, b = args[0], args[1]
        elif packet in (_aten.addmm, _aten.baddbmm, _aten.addmv):
            a, b = args[1], args[2]
        else:
            return func(*args, **(kwargs or {}))
        self.flops += 2 * a.numel() * (b.shape[-1] if b.dim() > 1 else 1)
        return func(*args, **(kwargs or {}))
