"""Instructors only: the students' copy holds no statement of a solution, in any file."""

import json

from course.release import leaks, release, secret_lines, squeeze

HOOK = "param.register_post_accumulate_grad_hook(partial(self._gradient_ready, bucket))"  # solutions/mydp.py


def test_leak_check_finds_solution_statements_in_handouts_and_notebooks(tmp_path):
    dest = tmp_path / "release"
    release(str(dest))
    assert leaks(str(dest)) == []
    assert squeeze(HOOK) in secret_lines()
    assert squeeze("rank, world_size = dist.get_rank(), dist.get_world_size()") not in secret_lines(), (
        "a line that also stands outside the solution regions is given to students anyway"
    )

    handout = dest / "exercises" / "06_overlap.md"
    original = handout.read_text()
    respaced = "Register `param.register_post_accumulate_grad_hook( partial(self._gradient_ready,bucket) )` on each."
    handout.write_text(original + respaced + "\n")
    assert leaks(str(dest)) == [("exercises/06_overlap.md", respaced)], (
        "a solution statement with other spacing, inside prose"
    )
    wrapped = ["Then `param.register_post_accumulate_grad_hook(partial(", "self._gradient_ready, bucket))` and done."]
    handout.write_text(original + "\n".join(wrapped) + "\n")
    assert leaks(str(dest)) == [("exercises/06_overlap.md", wrapped[0])], "a solution statement wrapped over two lines"
    handout.write_text(original)

    notebook = dest / "exercises" / "03_ddp.ipynb"
    nb = json.loads(notebook.read_text())
    answer = "R means, which is the mean gradient over all R x B rows: the step one process would take on a"  # the model answer of solutions/notebooks/03_ddp.md
    nb["cells"].append({"cell_type": "markdown", "id": "leak", "metadata": {}, "source": [f"Hint: {answer} batch.\n"]})
    notebook.write_text(json.dumps(nb))
    assert leaks(str(dest)) == [("exercises/03_ddp.ipynb", f"Hint: {answer} batch.")], (
        "a model answer in a released notebook"
    )
