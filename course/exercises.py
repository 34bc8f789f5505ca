"""The exercises, as data: the one list that grading, the release, the notebooks, the instructors'
demo, compatibility and GPU checks, the class report and the README's test all read.

An exercise is its own files (the student file's part in solutions/, its handout and notebook
source, its checks in checks/, its mutants in tests/mutants/) and one entry here. Every path an
exercise has follows from its number and name: exercise 2, "dist", has the handout
exercises/02_dist.md, the notebook exercises/02_dist.ipynb made from solutions/notebooks/02_dist.md,
and the checks checks/test_ex02_dist.py. docs/design.md, "Adding an exercise", walks through one.

This module imports nothing of the course: every layer may read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    number: int
    name: str  # the short name in its files' names: "dist"
    file: str  # the student file it is written in (several exercises may share one)
    topic: str  # what the student writes there, as the README's path table says it
    run: tuple  # the commands that show it, as the README's path table names them
    points: int  # its checks' points: the sum of their @pytest.mark.points (a test compares)
    written: int  # its notebook's written answers' points, graded by hand (a test compares)
    demo: tuple = ()  # the reference scripts that show it, with their flags (the instructors' demo runs them)
    gpu: tuple = ()  # its rows of the instructors' GPU check (course/instructors/gpu_check.py measures each)
    # torch's own version of what the student writes here by hand (course/runtime/uprobes.py's ENTRIES): where the
    # kernel counts calls, a check whose worlds called one fails, naming it (checks/helpers.py's world())
    forbids: tuple = ()

    @property
    def slug(self) -> str:
        return f"{self.number:02d}_{self.name}"

    @property
    def handout(self) -> str:
        return f"exercises/{self.slug}.md"

    @property
    def notebook(self) -> str:
        return f"exercises/{self.slug}.ipynb"

    @property
    def notebook_source(self) -> str:
        return f"solutions/notebooks/{self.slug}.md"

    @property
    def checks_module(self) -> str:
        return f"checks.test_ex{self.slug}"

    @property
    def checks(self) -> str:
        return f"checks/test_ex{self.slug}.py"


# fmt: off
EXERCISES = (
    Exercise(1, "mlp", "mlp.py", "the MLP and its evaluation", ("python mlp.py",), 20, 2,
             demo=("mlp.py --niters 300",), gpu=("1 MLP, one process",)),
    Exercise(2, "dist", "dist.py", "matrix product by row and by reduction", ("python dist.py --world-size 3",), 25, 2,
             demo=("dist.py --world-size 3",), gpu=("2 matmul, by row and by reduction",)),
    Exercise(3, "ddp", "mlp.py", "built-in DDP, each rank its own batches", ("python mlp.py --world-size 2 --check",), 25, 2,
             demo=("mlp.py --world-size 2 --niters 300 --check",), gpu=("3 DDP", "3 DDP --amp")),
    Exercise(4, "mydp", "mydp.py", "`MyDP`, broadcast + gradient hooks",
             ("python mydp.py --world-size 2 --compare --check",), 30, 2,
             demo=("mydp.py --world-size 2 --niters 300 --compare",), gpu=("4 MyDP", "4 MyDP --amp"),
             forbids=("DistributedDataParallel",)),
    Exercise(5, "ring", "dist.py", "ring all-reduce from point-to-point messages",
             ("python dist.py --world-size 3 --ring 10",), 20, 2, gpu=("5 ring all-reduce",), forbids=("collective",)),
    Exercise(6, "overlap", "mydp.py", "`OverlappedDP`, asynchronous all-reduces in buckets",
             ("python mydp.py --world-size 2 --bucket-cap-mb 1",), 25, 2, gpu=("6 OverlappedDP, 1 MiB buckets",),
             forbids=("DistributedDataParallel",)),
    Exercise(7, "accumulation", "mydp.py", "`no_sync()` and gradient accumulation", ("python -m course grade --ex 7",),
             15, 2, forbids=("DistributedDataParallel",)),
    Exercise(8, "data", "data.py", "partitions by fractions, uneven shards, Join",
             ("python data.py --world-size 2 --uneven hang",), 25, 2,
             demo=("data.py --world-size 3", "data.py --world-size 2 --uneven join")),
    Exercise(9, "sync", "sync.py", "BatchNorm across ranks, parameter averaging, local SGD on non-IID shards",
             ("python sync.py --world-size 2", "python sync.py --non-iid-plot non_iid.png"), 25, 2,
             demo=("sync.py --world-size 2",), forbids=("model_averaging",)),
    Exercise(10, "hvd", "hvd.py", "the Horovod-style API, the optimizer averages", ("python hvd.py --world-size 2",),
             25, 2, demo=("hvd.py --world-size 2 --niters 300",)),
    Exercise(11, "zero", "zero.py", "sharded optimizer state (ZeRO-1), a bfloat16 DDP comm hook",
             ("python zero.py --world-size 2",), 25, 2,
             demo=("zero.py --world-size 2 --niters 300", "zero.py --world-size 2 --niters 300 --bf16-hook"),
             forbids=("ZeroRedundancyOptimizer", "comm_hooks")),
    Exercise(12, "cost", "cost.py", "the α-β cost model, predicted against measured", ("python cost.py",), 20, 6,
             demo=("cost.py",)),
    Exercise(13, "fsdp", "fsdp.py",
             "fully sharded data parallelism (ZeRO-2, ZeRO-3) against torch's `fully_shard`",
             ("python fsdp.py --world-size 2",), 30, 2, demo=("fsdp.py --world-size 2 --niters 50",),
             gpu=("13 ZeRO-2 and ZeRO-3 (final test loss)", "13 ZeRO-3, bfloat16 gathers (final test loss)"),
             forbids=("DTensor",)),
    Exercise(14, "tp", "tp.py",
             "tensor and sequence parallelism, forward and backward, against torch's `parallelize_module`",
             ("python tp.py --world-size 2 --sequence-parallel",), 30, 4,
             demo=("tp.py --world-size 2 --niters 300", "tp.py --world-size 2 --niters 300 --sequence-parallel"),
             gpu=("14 tensor parallel (final loss)", "14 sequence parallel (final loss)"), forbids=("DTensor",)),
    Exercise(15, "pp", "pp.py", "pipeline parallelism, GPipe then 1F1B, from point-to-point messages",
             ("python pp.py --world-size 2 --schedule 1f1b",), 30, 2,
             demo=("pp.py --world-size 2 --schedule 1f1b --niters 300",), gpu=("15 pipeline, 1F1B",),
             forbids=("pipelining",)),
    Exercise(16, "nd", "nd.py",
             "data × tensor parallel on a mesh of process sub-groups (`dist.new_group`), by hand",
             ("python nd.py --dp 2 --tp 2",), 20, 2, demo=("nd.py --dp 2 --tp 2 --niters 100",),
             gpu=("16 data x tensor parallel mesh (final loss)",), forbids=("DTensor",)),
    Exercise(17, "ft", "ft.py", "a rank dies: sharded checkpoints, a restart on the same or another world size",
             ("python ft.py --world-size 4 --kill 1@10 --restart-on 3",), 30, 2,
             demo=("ft.py --world-size 4 --kill 1@10 --restart-on 3 --compare", "ft.py --world-size 3 --kill 2@12 --in-save")),
    Exercise(18, "moe", "moe.py", "expert parallelism: a mixture of experts whose tokens travel by all-to-all",
             ("python moe.py --ep 2 --capacity-factor 1",), 30, 2, demo=("moe.py --dp 2 --ep 2 --niters 100",),
             gpu=("18 expert parallel, dp x ep mesh (final loss)",)),
)
# fmt: on

# The files students write, in the order their exercises come; each made from solutions/ (make student).
STUDENT_FILES = tuple(dict.fromkeys(exercise.file for exercise in EXERCISES))
STUDENT_MODULES = tuple(name[: -len(".py")] for name in STUDENT_FILES)


def by_number(number: int) -> Exercise:
    """The exercise of that number (KeyError for none: course/grading/results.py's no_such_exercise words the refusal)."""
    for exercise in EXERCISES:
        if exercise.number == number:
            return exercise
    raise KeyError(number)


def of_checks(path: str) -> Exercise | None:
    """The exercise whose checks module is at path (a file's path or a pytest node id), None for any other."""
    module = path.split("::")[0].replace("\\", "/")
    return next((e for e in EXERCISES if module == e.checks or module.endswith("/" + e.checks)), None)


def of_checks_module(name: str) -> Exercise | None:
    """The exercise whose checks module has that name ("checks.test_ex04_mydp"), None for any other."""
    return next((e for e in EXERCISES if e.checks_module == name), None)


# A stub, as course/instructors/student.py writes it into a student file: the sentence a student reads
# when their code reaches it, and the facts the grader reads back from it (stub_facts), in one place.
_STUB = re.compile(r"Exercise (\d+): (\S+) is not written yet, see (\S+)")


def stub_message(number: int, function: str) -> str:
    return f"Exercise {number}: {function} is not written yet, see {by_number(number).handout}"


def stub_facts(message: str) -> dict | None:
    """{"exercise", "func", "handout"} of a stub's message (stub_message), or None for any other message."""
    match = _STUB.fullmatch(message.strip())
    return dict(exercise=int(match.group(1)), func=match.group(2), handout=match.group(3)) if match else None
