"""course/runtime/compat.py: what differs across the supported torch versions; course/instructors/compat_check.py: make compat's
cached venv."""

import json
import os
import warnings

from course.runtime import compat


def test_one_name_per_collective_whichever_torch_carries_it():
    # torch 2.13 on: all_gather_single; 2.11 and 2.12: _allgather_base. The handout names neither.
    assert compat.collective("all_gather_single") == compat.collective("_allgather_base") == "all_gather_into_tensor"
    assert compat.collective("reduce_scatter_single") == compat.collective("_reduce_scatter_base")
    assert compat.collective("_reduce_scatter_base") == "reduce_scatter_tensor"
    assert compat.collective("allreduce") == "allreduce"


def test_only_the_renamed_collectives_warnings_are_silenced():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.quiet_renamed_collectives()
        warnings.warn(
            "`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning, stacklevel=1
        )
        warnings.warn(
            "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use ...", FutureWarning, stacklevel=1
        )
        warnings.warn("`torch.distributed.something_else` is deprecated.", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["`torch.distributed.something_else` is deprecated."]


def test_a_made_venv_is_used_again(tmp_path):
    """A venv whose torch is the version asked for is the one returned: nothing is installed again."""
    python = tmp_path / "compat-2.11.0" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\necho 2.11.0+cu130\n")  # what a CUDA build's torch.__version__ says
    python.chmod(0o755)
    from course.instructors import compat_check  # instructors only: not in the students' copy

    assert compat_check.venv_for("2.11.0", cache=str(tmp_path)) == str(python)
    assert os.path.exists(python)


def test_one_grade_of_every_exercise_is_split_by_exercise(tmp_path):
    """make compat grades every exercise in one grader, as a student's make grade does, and reads each
    exercise's score from the Gradescope names; a grader that wrote nothing scores 0 of 0."""
    python = tmp_path / "python"
    tests = [("Exercise 2: test_a", 5, 5), ("Exercise 2: test_b", 0, 10), ("Exercise 11: test_c", 3, 3)]
    results = {"score": 8, "tests": [{"name": n, "score": s, "max_score": m} for n, s, m in tests]}
    python.write_text(
        f'#!/bin/sh\nwhile [ "$1" != --results ]; do shift; done\necho \'{json.dumps(results)}\' > "$2"\n'
    )
    python.chmod(0o755)
    from course.instructors import compat_check

    scores, _ = compat_check.grade(str(python), [2, 11, 15], "solutions")
    assert scores == {2: (5, 15), 11: (3, 3), 15: (0, 0)}
    python.write_text("#!/bin/sh\nexit 1\n")
    assert compat_check.grade(str(python), [2], "solutions")[0] == {2: (0, 0)}
