"""What went wrong in a world of workers: facts per rank, and the one place that words them.

Workers describe their own failure as plain data (``rank_report``); the parent turns those
reports, or the stacks of ranks that never reported, into a ``Failure`` (``diagnose``,
``timed_out``). Every sentence a student reads about a failed world is written by
``Failure.report`` or ``Failure.sentence``: other modules read the fields, never the text.
"""

from __future__ import annotations

import functools
import linecache
import multiprocessing
import os
import re
import sysconfig
import traceback
from dataclasses import dataclass, field

import torch

from course.exercises import STUDENT_FILES, stub_facts, stub_message
from course.kinds import KINDS
from course.layout import CHECKS

# Frames that are the course's, Python's or an installed library's own, never the student's line:
# a crash inside ctypes or numpy is reported at the student's call.
_PLUMBING_DIRS = tuple(
    {os.path.abspath(sysconfig.get_paths()[key]) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    | {os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, multiprocessing)}
) + (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)  # course/, every layer
_COMM_LOG = os.path.join("checks", "comm_log.py")
C10D_FILE = "distributed_c10d.py"
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv")

_LIST_SIZE = re.compile(r"Incorrect (?:input|output) list size (\d+)")  # gloo's scatter/gather
_MISMATCH = "Detected mismatch between collectives"
_FINGERPRINT = (
    r"Rank {rank} is running collective: CollectiveFingerPrint\(.*?OpType=(\w+)(?:, TensorShape=(\[[^\]]*\]))?"
)
_SECONDARY = ("Connection closed by peer", "Connection reset by peer")
# A limit of a sandboxed world (course/runtime/sandbox.py's Limits) reached, as the error says it: the
# kernel's errno, or torch's allocator. The limit it is, and how the sentence names it.
_LIMIT_WORDS = {
    "disk": ("[Errno 28]",),  # ENOSPC: the world's own folder is full
    "file": ("[Errno 27]",),  # EFBIG: RLIMIT_FSIZE
    "memory": ("can't allocate memory", "[Errno 12]"),  # ENOMEM: RLIMIT_DATA
}
_LIMIT_SAID = {
    "disk": "a world's own folder (its HOME and TMPDIR) holds at most {} MiB of files where grades are made",
    "file": "no file a rank writes, its output where that is a file, may grow past {} MiB where grades are made",
    "memory": "a rank may allocate at most {} MiB of memory where grades are made",
}
# Why ranks wait for ever in dist.new_group (a timeout or a wait whose ranks are in it): torch pairs the
# ranks' calls by their order.
_NEW_GROUP_RULE = (
    "dist.new_group is called by every rank for every group, its own or not, in the same order (or by the group's"
    " members alone, each with use_local_synchronization=True, which torch 2.13 pairs only where every rank holds as"
    " many groups already: made after a group that some ranks are not in, it waits for ever, pytorch#173608)"
)
# A collective that not every rank joined: gloo's own timeout, or the checking group's barrier.
_WAITED = ("Timed out", "failed to pass monitoredBarrier")
_STACK_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')
# What a rank that runs writes, the second time the parent asks for its stack (course/runtime/instrument.py's
# Loops): the frames still running since the first time, innermost first.
_LOOP_HEAD = "Still running since the first ask (most recent call first):"
_LOOP = re.compile(re.escape(_LOOP_HEAD) + r"\n((?:  File .*\n)*)")
# A root's name, by the collective's OpType: the argument of torch.distributed's function.
_ROOT_NAME = {"BROADCAST": "src", "SCATTER": "src", "REDUCE": "dst", "GATHER": "dst"}
# What the ranks compare of a collective (course/runtime/instrument.py's Agreement), each with its key in
# ArgumentsDiffer's facts.
_ARGUMENTS = (("root", "roots"), ("reduce op", "ops"), ("shape", "shapes"), ("dtype", "dtypes"))


class ArgumentsDiffer(RuntimeError):
    """Raised on every rank when the ranks' collective, compared before it starts
    (course/runtime/instrument.py's Agreement), differs: each field is a list by rank."""

    def __init__(self, calls: list, roots: list, ops: list, dtypes: list, shapes: list):
        super().__init__(f"ranks called collectives that differ: {calls} {roots} {ops} {dtypes} {shapes}")
        self.facts = {"calls": calls, "roots": roots, "ops": ops, "dtypes": dtypes, "shapes": shapes}


@dataclass
class RankFact:
    rank: int
    state: str  # "raised" | "crashed" | "waited" | "running" | "echo" | "no_result" | "unwaited"
    error: str = ""  # exception class name, e.g. "RuntimeError"
    message: str = ""  # first line of the exception message
    file: str = ""  # the file (basename) of the rank's own frame (_own: in a student file where there is one)
    line: int = 0
    func: str = ""
    collective: str = ""  # torch.distributed function the rank was in or called ("all_reduce", "send", "wait")
    shape: str = ""  # tensor shape of that call when known
    peer: int | None = None  # for point-to-point: the rank it sent to / received from
    traceback: str = ""
    exit_code: int | None = None  # for a rank that ended without reporting
    when: float = float("inf")  # when it went wrong (time.time()): the first failure is the cause
    op: str = ""  # with collectives checked: its collective, by torch's OpType name ("ALLREDUCE")
    pieces: int | None = None  # a scatter/gather given a list of this many tensors for world_size ranks
    root: int | None = None  # with collectives checked: the root of its collective (src, dst), if it has one
    reduce_op: str = ""  # and its reduce op ("SUM")
    dtype: str = ""  # and its tensor's dtype ("float32")
    differs: tuple = ()  # what of the collective differs between the ranks: of _ARGUMENTS's names
    instance: tuple = ()  # the collective it waited in when it failed: (group, its number on it, what was called)
    moved: bool = False  # its waits board changed while the parent looked at it: it was still moving
    dropped: tuple = ()  # a message it freed unfinished, never waited for: (function, peer, file, line, func)
    # A group it waits to make, in the store: (its number among the groups its code made in the call, 0 for the
    # course's own; its ranks; whether it waits in the store's barrier after it rather than for its members).
    making: tuple = ()
    keys: tuple = ()  # the keys of the store it waits for
    unimportable: dict | None = None  # a student file that does not import: {"file": "mlp.py", "error": "SyntaxError"}
    limit: str = ""  # the limit of a sandboxed world its error says it reached: of _LIMIT_WORDS's
    judged: bool = False  # its own frame is a check's, not the student's: no line of the student's was running

    def argument(self) -> str:
        """What differs of its collective, as its function names it: 'with src=1', 'with op=MAX',
        'with a float64 tensor of shape [2]'."""
        said = []
        if "root" in self.differs:
            said.append(f"{_ROOT_NAME.get(self.op, 'root')}={self.root}")
        if "reduce op" in self.differs:
            said.append(f"op={self.reduce_op}")
        if "shape" in self.differs or "dtype" in self.differs:
            said.append(f"a {self.dtype} tensor of shape {self.shape}" if self.shape else "no tensor")
        return "with " + ", ".join(said)

    def where(self) -> str:
        # A check's line is the tests' plumbing: the student is told that none of theirs was running.
        if self.judged:
            return "a line of the check's own code, not of yours"
        if self.file:
            return f"{self.file}:{self.line} in {self.func}"
        if self.state == "running" and not stack_frames(self.traceback):
            return "a place not known (its stack did not come back in time)"
        if self.state in ("crashed", "no_result") and not stack_frames(self.traceback):
            # A fatal signal's handler writes a stack; SIGKILL and os._exit give the process no moment to.
            return "a place not known (it left no stack)"
        return "the end of the run (its function had returned)"

    def doing(self) -> str:
        """What the rank was doing, as 'waits in send to rank 1 at dist.py:57 in exchange'."""
        if self.collective in ("send", "isend"):
            call = f"{self.collective} to rank {self.peer}" if self.peer is not None else self.collective
        elif self.collective in ("recv", "irecv"):
            call = f"{self.collective} from rank {self.peer}" if self.peer is not None else self.collective
        else:
            call = self.collective
        shape = f" of shape {self.shape}" if self.shape and self.collective not in POINT_TO_POINT else ""
        said = f"in {call}{shape} at {self.where()}" if call else f"at {self.where()}"
        if self.making:
            number, ranks, barrier = self.making
            group = f"its {_ordinal(number)} group, of ranks {ranks}" if number else f"a group of ranks {ranks}"
            said += f", in the store's barrier after {group}" if barrier else f", making {group}"
        if self.keys:
            said += f", for key{'s' * (len(self.keys) > 1)} {', '.join(map(repr, self.keys))}"
        return said


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


@dataclass
class Failure:
    kind: str  # one of course/kinds.py's WORLD
    world_size: int
    ranks: list = field(default_factory=list)  # RankFact, by rank
    first: int | None = None  # the rank that went wrong first
    stub: dict | None = None  # for kind "stub": {"exercise": N, "func": name, "handout": path}
    limit: float = 0.0  # for kind "timeout": the world's limit in seconds
    interrupted: bool = False  # the user pressed Ctrl-C: a "timeout" they chose
    longer: str = ""  # for kind "timeout": how the user can give the world more time, where they can
    slow: bool = False  # for kind "timeout": every rank was in the same collective when its time ran out
    still: bool = False  # a deadlock the parent found while every rank still ran, none having reported (deadlock())
    limits: dict | None = None  # a sandboxed world's limits in MiB ({"disk": 256, ...}), where it had them

    def fact(self, rank: int) -> RankFact | None:
        return next((f for f in self.ranks if f.rank == rank), None)

    def on_its_way(self) -> bool:
        """Whether a world stopped at its limit was still moving: a rank computing, every rank in one collective
        (slow), a rank in a collective that a rank of its group has already passed (its number on the group
        below that rank's: its peers started it, so it can end, as a busy machine may leave one rank a step behind),
        or a rank whose board changed while the parent read its stack (its stack and its board then tell two moments),
        or a rank still joining the world (in init_process_group: a busy machine had not yet started every rank)."""
        if self.slow or any(
            f.state == "running" or f.moved or f.collective == "init_process_group" for f in self.ranks
        ):
            return True
        passed: dict = {}
        for f in self.ranks:
            if f.instance:
                passed[f.instance[0]] = max(passed.get(f.instance[0], f.instance[1]), f.instance[1])
        return any(f.instance and f.instance[1] < passed[f.instance[0]] for f in self.ranks)

    def _rank_lines(self) -> list:
        facts = self.ranks
        verb = {
            "waited": "waits",
            "running": "runs",
            "raised": "raised",
            "crashed": "crashed",
            "echo": "lost a peer",
            "no_result": "ended",
            "unwaited": "returned",
        }
        if self.kind == "mismatch":
            return [
                f"rank {f.rank} called {f.op or 'a collective'}{f' of shape {f.shape}' if f.shape else ''}"
                f"{f' in {f.collective}' if f.collective else ''} at {f.where()}"
                for f in facts
            ]
        if self.kind == "arguments":
            return [
                f"rank {f.rank} {f.argument()}{f' in {f.collective}' if f.collective else ''} at {f.where()}"
                for f in facts
            ]
        return [f"rank {f.rank} {verb.get(f.state, f.state)} {f.doing()}" for f in facts]

    def _head(self) -> str:
        first = self.fact(self.first) if self.first is not None else None
        w = self.world_size
        if self.kind == "stub":
            return stub_message(self.stub["exercise"], self.stub["func"])
        if self.kind == "mismatch":
            return f"Ranks called different collectives (world of {w}):"
        if self.kind == "arguments":
            first = self.ranks[0]
            names = [{"root": _ROOT_NAME.get(first.op, "root"), "reduce op": "op"}.get(d, d) for d in first.differs]
            name = " and ".join(names)
            return (
                f"Ranks called {first.collective or first.op} with a different {name} (world of {w}):"
                f" every rank must pass the same {name}:"
            )
        if self.kind == "p2p_deadlock":
            head = f"Deadlock (world of {w}): every rank waits in a send or receive that no peer answers."
            dropped = next((f for f in self.ranks if f.dropped), None)
            if dropped:
                call, peer, file, line, func = dropped.dropped
                return (
                    f"{head} Rank {dropped.rank} never waited for its {call} {'to' if 'send' in call else 'from'}"
                    f" rank {peer} (started at {file}:{line} in {func}): gloo drops a message whose request is freed"
                    " before it ends, so its peer waits for ever. Wait for every request before returning:"
                )
            if all(f.collective in ("send", "recv") for f in self.ranks):
                return head + " Start sends and receives with isend/irecv before waiting for any:"
            # Started without blocking already: the messages themselves do not match.
            return head + " A send to rank r needs rank r to receive from this rank, in the same order:"
        if self.kind == "wait":
            waited = [f.rank for f in self.ranks if f.state == "waited"]
            if self._in_new_group():
                return f"Ranks {waited} waited, some of them in dist.new_group. {_NEW_GROUP_RULE}:"
            if any(f.keys for f in self.ranks):
                return f"Ranks {waited} waited, some of them for a key of the store that no rank will set (every rank waits):"
            return (
                f"Ranks {waited} waited in a collective that not every rank joined:"
                " one rank skipped a collective or called a different one:"
            )
        if self.kind == "timeout":
            if self.slow:
                call = self.ranks[0].collective or "collective"
                return (
                    f"Every rank was in the same {call} when its time ran out (world of {w}): it was slow, not"
                    " mismatched (a busy machine, or more data than the time allows). Where each rank was:"
                )
            if self.interrupted:
                return f"Interrupted: stopped all {w} workers. Where each rank was:"
            ranks = [f.rank for f in self.ranks]
            if self._in_new_group():
                return (
                    f"Timed out after {self.limit:g} s: ranks {ranks} never finished, some of them in"
                    f" dist.new_group. {_NEW_GROUP_RULE}. Where each rank was:"
                )
            if self.longer:
                return (
                    f"Timed out after {self.limit:g} s: ranks {ranks} were still running (a loop that does not end,"
                    f" or a run that needs {self.longer}?). Where each rank was:"
                )
            return (
                f"Timed out after {self.limit:g} s: ranks {ranks} never finished (a loop that does not end,"
                " or a wait for what never comes?). Where each rank was:"
            )
        if self.kind == "unwaited":
            return (
                f"Rank {first.rank} returned while its {first.collective} {'to' if first.collective == 'isend' else 'from'}"
                f" rank {first.peer} (started at {first.where()}) was never waited for: call .wait() on every request before returning."
            )
        if self.kind == "no_result":
            how = first.message or f"exited with code {first.exit_code}"
            return f"Rank {first.rank} of {w} ended without sending its result: {how} (at {first.where()})."
        if self.kind == "crash":
            sig = f" (signal {-first.exit_code})" if first.exit_code is not None and first.exit_code < 0 else ""
            if first.exit_code == -9:
                sig = " (signal 9, SIGKILL: sent by another process, or by the kernel when memory ran out)"
            return f"Rank {first.rank} of {w} crashed with exit code {first.exit_code}{sig} at {first.where()}."
        if first.pieces is not None:
            return (
                f"Rank {first.rank} of {w} gave {first.collective} {first.pieces} tensors for {w} ranks: its list takes"
                f" one tensor per rank (at {first.where()})"
            )
        said = f"{first.error}: {first.message} (at {first.where()}){self._limit()}"
        return f"Rank {first.rank} of {w} failed first: {said}"

    def _limit(self) -> str:
        """Where the first rank's error is a limit of its sandboxed world reached: which, and how much."""
        first = self.fact(self.first) if self.first is not None else None
        if first is None or not first.limit or not self.limits:
            return ""
        name = first.limit
        return f": {_LIMIT_SAID[name].format(self.limits[name])} (COURSE_LIMIT_{name.upper()})"

    def _in_new_group(self) -> bool:
        return any(f.collective == "new_group" or f.making for f in self.ranks)

    def sentence(self) -> str:
        """One line for the grade table."""
        head = self._head()
        if KINDS[self.kind].story:
            return f"{head} {'; '.join(self._rank_lines())}"
        return head

    def report(self) -> str:
        """The text a script prints."""
        head = self._head()
        if KINDS[self.kind].story:
            return "\n".join([head] + ["  " + line for line in self._rank_lines()])
        if self.kind == "error":
            first = self.fact(self.first)
            others = [f for f in self.ranks if f.rank != self.first]
            alike = all(
                f.state == "raised" and (f.error, f.file, f.line) == (first.error, first.file, first.line)
                for f in others
            )
            if others and alike:  # the mistake is every rank's own, not one rank's that stopped the others
                tail = f"\n(Every rank raised this {first.error} at the same line.)"
            elif others:
                tail = f"\n(ranks {[f.rank for f in others]} failed after it, most likely because rank {first.rank} stopped.)"
            else:
                tail = ""
            said = self._limit()[2:]  # without its ": "
            limit = f"\n{said[:1].upper()}{said[1:]}." if said else ""
            return (
                f"Rank {first.rank} of {self.world_size} failed first:\n{first.traceback.strip() or first.message}"
                f"{limit}{tail}"
            )
        if self.kind == "crash":
            frames = stack_frames(self.fact(self.first).traceback)[::-1]
            if not frames:
                return head
            return "\n".join(
                [head, "Its stack, innermost first:"] + [f"  {os.path.basename(p)}:{n} in {fn}" for p, n, fn in frames]
            )
        return head


def first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


# --- frames ---------------------------------------------------------------------------------


@functools.cache
def is_plumbing(path: str) -> bool:
    path = os.path.abspath(path)
    return path.startswith(_PLUMBING_DIRS) or path.endswith(os.sep + _COMM_LOG)


@functools.cache
def is_student_file(path: str) -> bool:
    return os.path.basename(path) in STUDENT_FILES


@functools.cache
def is_check_file(path: str) -> bool:
    return os.path.abspath(path).startswith(os.path.join(CHECKS, "")) and not is_student_file(path)


def _own(frames: list) -> tuple | None:
    """The innermost of (path, line, func) frames, outermost first, that is the student's: in a student
    file where there is one (a check's function that the student's code calls, the check that called
    it, are not where to look), else any that is not plumbing (a script's own function)."""
    own = [f for f in frames if not is_plumbing(f[0])]
    return next((f for f in reversed(own) if is_student_file(f[0])), own[-1] if own else None)


def _call_in(frames: list) -> str:
    """The torch.distributed function a rank was in: the innermost one, or a request's wait()."""
    own = _own(frames)
    after = frames[frames.index(own) + 1 :] if own else frames
    dist_calls = [f[2] for f in after if f[0].endswith(C10D_FILE)]
    if dist_calls:
        return dist_calls[0]
    if any(f[2] == "wait" for f in after) or (own and ".wait(" in linecache.getline(own[0], own[1])):
        return "wait"
    return ""


def _fill_place(fact: RankFact, frames: list) -> RankFact:
    own = _own(frames)
    if own:
        fact.file, fact.line, fact.func = os.path.basename(own[0]), own[1], own[2]
        fact.judged = is_check_file(own[0])
    fact.collective = fact.collective or _call_in(frames)
    return fact


# --- in the worker --------------------------------------------------------------------------


def _call_details(tb) -> dict:
    """Shape and peer of the innermost torch.distributed call in a live traceback."""
    details = {}
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.endswith(C10D_FILE):
            local = frame.f_locals
            tensor = local.get("tensor")
            if isinstance(tensor, torch.Tensor):
                details["shape"] = str(list(tensor.shape))
            for name in ("dst", "src", "group_dst", "group_src"):
                if isinstance(local.get(name), int) and frame.f_code.co_name in POINT_TO_POINT:
                    details["peer"] = local[name]
        tb = tb.tb_next
    return details


def rank_report(
    rank: int, exc: BaseException, when: float, p2p: dict | None = None, wait: dict | None = None, dropped: list = ()
) -> dict:
    """What a worker sends when fn raised: plain data only. ``p2p``: the message it waited for; ``wait``:
    what it waited in when it raised, as course/runtime/instrument.py's Waits says it; ``dropped``: a message it
    freed unfinished (PointToPoint.dropped)."""
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    report = dict(
        rank=rank,
        when=when,
        error=type(exc).__name__,
        message=first_line(str(exc)),
        full_message=str(exc),
        traceback=traceback.format_exc(),
        frames=frames,
        **_call_details(exc.__traceback__),
    )
    if p2p:  # stuck in a message's wait(): what it was and with whom
        report.update(collective=p2p["collective"], peer=p2p["peer"])
    if isinstance(exc, ArgumentsDiffer):
        report["agreement"] = exc.facts
    if isinstance(getattr(exc, "unimportable", None), dict):  # course/impl.py's NotImportable
        report["unimportable"] = exc.unimportable
    if instance(wait):
        report["instance"] = list(instance(wait))
    if dropped:
        report["dropped"] = list(dropped)
    return report


def unwaited_report(rank: int, when: float, pending: dict) -> dict:
    """What a worker sends when fn returned with a point-to-point request never waited for."""
    return dict(
        rank=rank,
        when=when,
        state="unwaited",
        collective=pending["collective"],
        peer=pending["peer"],
        frames=[tuple(pending["frame"])],
        message="",
        error="",
    )


# --- in the parent --------------------------------------------------------------------------


def _fact(report: dict) -> RankFact:
    error, full = report.get("error", ""), report.get("full_message", "")
    if report.get("state") in ("unwaited", "waited"):  # said by the worker: nothing raised
        state = report["state"]
    elif error == "SystemExit":
        state = "no_result"
    elif any(m in full for m in _SECONDARY):
        state = "echo"
    elif _MISMATCH in full or any(m in full for m in _WAITED):
        state = "waited"
    else:
        state = "raised"
    fact = RankFact(
        report["rank"],
        state,
        error,
        report.get("message", ""),
        traceback=report.get("traceback", ""),
        when=report["when"],
        collective=report.get("collective", ""),
        shape=report.get("shape", ""),
        peer=report.get("peer"),
        instance=tuple(report.get("instance", ())),
    )
    found = report.get("unimportable")
    if isinstance(found, dict) and all(isinstance(found.get(k), str) for k in ("file", "error")):
        fact.unimportable = {"file": found["file"], "error": found["error"]}
    if report.get("kind") == "group":  # a record of course/runtime/instrument.py's Waits
        fact.making = (report["number"], list(report["ranks"]), report["phase"] == "barrier")
    elif report.get("kind") == "key":
        fact.keys = tuple(report["keys"])
    if report.get("dropped"):
        call, peer, (path, line, func) = report["dropped"]
        fact.dropped = (call, peer, os.path.basename(path), line, func)
    if error == "SystemExit":
        fact.message = f"it called sys.exit({report.get('message', '')})"
    if error == "MemoryError":
        fact.limit = "memory"
    fact.limit = fact.limit or next((k for k, words in _LIMIT_WORDS.items() if any(w in full for w in words)), "")
    match = re.search(_FINGERPRINT.format(rank=fact.rank), full)
    if match:
        fact.op, fact.shape = match.group(1), match.group(2) or ""
    agreed = report.get("agreement")
    if agreed:  # every rank's collective, as the ranks compared them: this rank's own
        fact.op, fact.root, fact.reduce_op = (agreed[k][fact.rank] for k in ("calls", "roots", "ops"))
        shape, fact.dtype = agreed["shapes"][fact.rank], agreed["dtypes"][fact.rank] or ""
        fact.shape = str(shape) if shape is not None else ""
        fact.differs = tuple(name for name, key in _ARGUMENTS if len(set(map(str, agreed[key]))) > 1)
        fact.state = "raised"
    fact = _fill_place(fact, [tuple(f) for f in report.get("frames", [])])
    pieces = _LIST_SIZE.search(full)  # torch's own words, read in one place
    if pieces and fact.collective:
        fact.pieces = int(pieces.group(1))
    return fact


def ended_without_report(
    rank: int, exit_code: int | None, stack: str, reason: str = "", when: float = float("inf")
) -> RankFact:
    """A rank whose process ended without a report (a crash, an early exit), noticed at ``when``."""
    state = "crashed" if exit_code is not None and exit_code < 0 else "no_result"
    fact = RankFact(rank, state, message=reason, exit_code=exit_code, traceback=stack, when=when)
    return _fill_place(fact, stack_frames(stack))


def running(rank: int, stack: str) -> RankFact:
    """A rank still running when the world was stopped: where it loops, when it wrote that (loop_dump),
    else where its faulthandler stack was."""
    fact = _fill_place(RankFact(rank, "running", traceback=stack), loop_frames(stack) or stack_frames(stack))
    if fact.collective:
        fact.state = "waited"
    return fact


def stack_frames(dump: str) -> list:
    """(path, line, func) of the main thread in a faulthandler dump, outermost first."""
    blocks = re.split(r"^(?=(?:Current thread|Thread) 0x)", dump, flags=re.M)
    main = next((b for b in blocks if b.startswith("Current thread")), blocks[-1] if blocks else "")
    frames = [(m["path"], int(m["line"]), m["func"]) for m in _STACK_FRAME.finditer(main)]
    return frames[::-1]


def loop_dump(frames: list) -> str:
    """(path, line, func) frames, outermost first, still running since the parent first asked, as
    loop_frames reads them: the innermost is where the rank loops."""
    return _LOOP_HEAD + "\n" + "".join(f'  File "{path}", line {line} in {func}\n' for path, line, func in frames[::-1])


def loop_frames(dump: str) -> list:
    """(path, line, func) of the last loop_dump in a rank's stack file, outermost first."""
    found = list(_LOOP.finditer(dump))
    frames = [(m["path"], int(m["line"]), m["func"]) for m in _STACK_FRAME.finditer(found[-1][1])] if found else []
    return frames[::-1]


def diagnose(reports: list, ended: list, world_size: int, limits: dict | None = None) -> Failure:
    """The failure of a world from the reports that ranks sent and the ranks that ended without one;
    ``limits``: those of its sandbox, in MiB, where it had them."""
    facts = sorted([_fact(r) for r in reports] + ended, key=lambda f: f.rank)
    # The root cause: a rank's own error before any peer's echo, earliest first (gloo may close a
    # socket a moment before the Python exception on that rank is raised and stamped).
    first = min(facts, key=lambda f: (f.state == "echo", f.state == "waited", f.when))
    failure = Failure("error", world_size, facts, first.rank, limits=limits)
    stub = stub_facts(first.message) if first.error == "NotImplementedError" else None
    if stub:
        failure.kind, failure.stub = "stub", stub
    elif any(f.state == "unwaited" for f in facts):
        failure.kind, failure.first = "unwaited", next(f.rank for f in facts if f.state == "unwaited")
    elif first.state == "crashed":
        failure.kind = "crash"
    elif first.state == "no_result":
        failure.kind = "no_result"
    elif any(f.op for f in facts):
        calls = {f.op for f in facts if f.op}
        failure.kind = "arguments" if len(calls) == 1 and any(f.differs for f in facts) else "mismatch"
    elif all(f.state in ("waited", "echo", "running") for f in facts):
        for f in facts:  # a peer's echo while it waited too: it lost the connection where it waited
            if f.state == "echo" and f.collective:
                f.state = "waited"
        shown = [f for f in facts if f.state != "echo"]
        p2p = all(
            f.state == "waited" and f.collective in POINT_TO_POINT + ("wait",) and f.peer is not None for f in shown
        )
        failure.kind = "p2p_deadlock" if shown and p2p else "wait"
        failure.ranks = shown
        if _in_one_collective(shown, world_size):
            # It timed out on a rank before the slowest came (a loaded machine): nothing was skipped.
            failure.kind, failure.slow = "timeout", True
    return failure


def instance(wait: dict | None) -> tuple:
    """What names a collective alike on every rank, from what course/runtime/instrument.py's Waits says a rank
    waits in: its group, its number on that group, what was called and its root (() for a message)."""
    if not wait or wait["kind"] != "collective":
        return ()
    return (wait["group"], wait["seq"], wait["call"], wait["root"])


def _in_one_collective(facts: list, world_size: int) -> bool:
    """Whether every rank of the world waited in one collective, the same by its number and arguments."""
    first = facts[0].instance if facts else ()
    return len(facts) == world_size and bool(first) and all(f.instance == first for f in facts)


def _may_end(wait: dict, waits: dict) -> bool:
    """Whether what one rank waits in can still end, by what its peers wait in and have started (records of
    course/runtime/instrument.py's Waits, by rank): a message, once its peer started the one that it pairs with; a
    collective, once every member started it, and none waits in another of that number; a group being made, as
    _may_make says; a key of the store never (only a rank that runs sets one)."""
    if wait["kind"] == "key":
        return False
    if wait["kind"] == "group":
        return _may_make(wait, waits)
    if wait["kind"] == "message":
        peers = [wait["to"]] if wait["to"] is not None else [r for r in waits if r != wait["rank"]]
        return any(_pairs(wait, offer) for peer in peers for offer in waits[peer]["offers"])
    for member in wait["members"]:
        other = waits[member]
        if other["kind"] == "collective" and (other["group"], other["seq"]) == (wait["group"], wait["seq"]):
            if other["call"] != wait["call"]:
                return False
        elif other["started"].get(wait["group"], 0) < wait["seq"]:
            return False
    return True


def _pairs(wait: dict, offer: list) -> bool:
    """Whether a peer's message started and not yet waited for to its end (course/runtime/instrument.py's
    PointToPoint.offers) may be the one that a rank's message waits for. gloo pairs two ranks' messages of a group
    and tag in the order each rank starts them: the k-th receive from rank r takes r's k-th send to it, or a later
    one where a receive from any rank came before it (it may have taken one); the k-th send to rank r goes to r's
    k-th receive from this rank, or an earlier one after r's receives from any rank. A message whose request was
    freed before it ended is never offered (gloo drops it): the receive it was for waits for ever."""
    group, direction, to, tag, number = offer
    wanted = "recv" if wait["direction"] == "send" else "send"
    if (group, direction, tag) != (wait["group"], wanted, wait["tag"]) or to not in (wait["rank"], None):
        return False
    if wait["direction"] == "send":
        return to is None or number <= wait["number"]
    if wait["to"] is None:
        return True
    return number == wait["number"] if wait["exact"] else number >= wait["number"]


def _may_make(wait: dict, waits: dict) -> bool:
    """Whether a group being made can still be. gloo connects the ranks that make a group of its name (torch's:
    a count of the groups made, the same on every rank only where every rank made every group in the same
    order) by their place in it: once every place is taken, by one rank of a group of its size, it can end.
    Two in one place (ranks that each made their own group under one name) pair wrongly or wait for ever: taken
    as never. The store's barrier after it (TORCH_DIST_INIT_BARRIER) ends once every rank it counts has made
    the group and is not connecting in it."""
    name = wait["group"]
    made = {rank: other["made"].get(name) for rank, other in waits.items()}
    if wait["phase"] == "barrier":
        return all(
            made.get(rank) is not None
            and (waits[rank]["kind"], waits[rank].get("group"), waits[rank].get("phase")) != ("group", name, "connect")
            for rank in wait["within"]
        )
    size = len(wait["ranks"])
    for place in range(size):
        taken = [m for m in made.values() if m is not None and m[0] == place]
        if len(taken) != 1 or taken[0][1] != size:
            return False
    return True


def deadlock(waits: list, world_size: int) -> Failure | None:
    """The failure of a world whose every rank waits (``waits``: each rank's record, as course/runtime/instrument.py's
    Waits says it) in what no peer can ever answer: each waits for a peer that waits too, or that has
    finished (it waits in the launcher's barrier), or for a group or a key of the store that no rank can
    make or set now, so nothing can move. None where a wait may still end."""
    by_rank = {w["rank"]: w for w in waits}
    if sorted(by_rank) != list(range(world_size)) or any(_may_end(w, by_rank) for w in waits):
        return None
    found = diagnose(waits, [], world_size)
    found.still = True
    return found


def timed_out(facts: list, world_size: int, limit: float, interrupted: bool = False) -> Failure:
    facts = sorted(facts, key=lambda f: f.rank)
    failure = Failure("timeout", world_size, facts, None, limit=limit, interrupted=interrupted)
    failure.slow = not interrupted and _in_one_collective(facts, world_size)
    return failure
