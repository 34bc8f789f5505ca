"""The student files: generated from solutions/, importable, and stopping at the first TODO."""

import os
import re

import pytest

from checks.test_ex01_mlp import check_layers
from checks.test_ex02_dist import check_matmul
from checks.test_ex03_ddp import check_closeness
from checks.test_ex04_mydp import check_start_sync
from checks.test_ex05_ring import check_ring
from checks.test_ex06_overlap import check_bucket_parameters
from checks.test_ex08_data import check_shard_sizes
from checks.test_ex09_sync import check_average_parameters, check_forward
from checks.test_ex10_hvd import check_broadcast_parameters
from checks.test_ex11_zero import check_owners
from checks.test_ex12_cost import check_fit
from checks.test_ex13_fsdp import check_flat_shard
from checks.test_ex14_tp import check_function
from course import impl
from course.exercises import EXERCISES, STUDENT_FILES
from course.grading import points as checks
from course.instructors.student import BEGIN, ROOT, SOLUTIONS, stub_source
from course.launch import WorldFailed
from tests import warm
from tests.mutants import make_mutant

STUB = re.compile(r'raise NotImplementedError\("(Exercise (\d+): \S+ is not written yet, see (\S+))"\)')


@pytest.mark.parametrize("name", STUDENT_FILES)
def test_student_file_is_generated_from_solution(name):
    with open(os.path.join(SOLUTIONS, name)) as f:
        expected = stub_source(f.read(), name)
    with open(os.path.join(ROOT, name)) as f:
        assert f.read() == expected, (
            f"{name} differs from what `make student` makes of solutions/{name}: run `make student`"
        )


@pytest.mark.parametrize("name", STUDENT_FILES)
def test_stubs_name_exercise_and_existing_handout(name):
    with open(os.path.join(ROOT, name)) as f:
        text = f.read()
    stubs = STUB.findall(text)
    assert stubs and BEGIN not in text
    for _, exercise, handout in stubs:
        assert os.path.exists(os.path.join(ROOT, handout)), f"the stub points at {handout}, which does not exist"
        assert os.path.basename(handout).startswith(f"{int(exercise):02d}_")


def test_student_files_import():
    ex = impl.load(ROOT)
    assert ex.mlp.ModelConfig().d_in == 1024 and callable(ex.mydp.MyDP)


@pytest.mark.parametrize(
    "check, exercise",
    [
        (check_layers, 1),
        (lambda f: check_matmul(f, 2), 2),
        (lambda f: check_closeness(f, 2), 3),
        (lambda f: check_start_sync(f, 2), 4),
        (lambda f: check_ring(f, 2), 5),
        (check_bucket_parameters, 6),
        (check_shard_sizes, 8),
        (lambda f: check_forward(f, 2), 9),
        (lambda f: check_average_parameters(f, 2), 9),
        (lambda f: check_broadcast_parameters(f, 2), 10),
        (check_owners, 11),
        (check_fit, 12),
        (check_flat_shard, 13),
        (lambda f: check_function(f, "Copy"), 14),
    ],
)
def test_untouched_stubs_fail_fast_with_their_message(check, exercise):
    with pytest.raises((NotImplementedError, WorldFailed)) as caught:
        check(ROOT)
    assert str(caught.value).startswith(f"Exercise {exercise}: "), str(caught.value)


@pytest.mark.parametrize(
    "command, message",
    [
        (["mlp.py", "--niters", "5"], "Exercise 1: MLP.__init__ is not written yet, see exercises/01_mlp.md"),
        (
            ["dist.py", "--world-size", "2"],
            "Exercise 2: par_matmul_by_row is not written yet, see exercises/02_dist.md",
        ),
        (
            ["data.py", "--world-size", "2"],
            "Exercise 8: partition is not written yet, see exercises/08_data.md",
        ),
        (
            ["mydp.py", "--world-size", "2", "--niters", "5"],
            "Exercise 1: MLP.__init__ is not written yet, see exercises/01_mlp.md",
        ),
        (
            ["sync.py", "--world-size", "2"],
            "Exercise 9: SyncBatchNorm1d.forward is not written yet, see exercises/09_sync.md",
        ),
    ],
)
def test_cli_stops_at_first_stub_with_one_line(command, message):
    done = warm.run(command, cwd=ROOT, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == message, done.stderr


def test_readme_path_lists_every_exercise_with_its_points():
    """The README's path table is course/exercises.py's, row for row: each exercise's file, topic, commands,
    handout, and the points of its written answers (the notebook's answer cells, graded by hand) and of
    its checks; the registry's points are those the notebooks and the checks' marks give
    (course/grading/points.py); the last row, their totals."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for e in EXERCISES:
        with open(os.path.join(ROOT, e.notebook_source)) as f:
            written = sum(map(int, re.findall(r"^```answer id=\S+ points=(\d+)", f.read(), re.M)))
        assert written == e.written, f"exercise {e.number}: its notebook's answers are worth {written}, not {e.written}"
        commands = ", ".join(f"`{command}`" for command in e.run)
        row = f"| {e.number} | `{e.file}`: {e.topic} | {commands} | [{e.slug}.md]({e.handout}), `{e.slug}.ipynb` |"
        assert f"{row} {e.written} | {e.points} |" in readme.splitlines(), (
            f"the README's row of exercise {e.number}: {row}"
        )
    assert {e.number: e.points for e in EXERCISES} == checks.points(), (
        "course/exercises.py's points should be those of each exercise's checks (course/grading/points.py)"
    )
    assert len(re.findall(r"^\| \d+ \|", readme, re.M)) == len(EXERCISES), "a row for each exercise, no more"
    a, b = sum(e.points for e in EXERCISES), sum(e.written for e in EXERCISES)
    assert f"| | total: {a} + {b} = {a + b} points | | | {b} | {a} |" in readme, "the totals row"


SMALL_RUN = [
    "--world-size",
    "2",
    "--n-layers",
    "3",
    "--dim-in",
    "12",
    "--n-classes",
    "4",
    "--dim-hidden",
    "10",
    "--batch-size",
    "8",
    "--train-size",
    "160",
    "--niters",
    "3",
]


def run_script(folder, *args):
    return warm.run(["mydp.py", *SMALL_RUN, *args], cwd=folder)


def test_script_shows_a_missing_broadcast(tmp_path):
    """Ranks draw different initial weights, so a MyDP that skips its broadcast shows in the script."""
    reference = run_script(SOLUTIONS, "--check")
    assert reference.returncode == 0 and "parameters close across ranks: True" in reference.stdout, reference.stderr
    mutant = make_mutant(tmp_path, "mydp.py", "dist.broadcast(tensor, src=0)", "pass")
    unchecked = run_script(mutant)
    assert unchecked.returncode == 0 and "parameters close across ranks: False" in unchecked.stdout, unchecked.stderr
    checked = run_script(mutant, "--check")
    assert checked.returncode == 1
    assert (
        "ranks hold different parameters before the first step: does the wrapper start every rank" in checked.stderr
    ), checked.stderr
