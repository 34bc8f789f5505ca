"""Exercise 17's script end to end: a rank killed, the newest checkpoint loaded on fewer ranks, torch's beside it."""

import os
import re
import subprocess
import sys

from course.layout import SOLUTIONS


def test_the_script_restarts_from_the_newest_checkpoint_on_fewer_ranks_as_torch_does():
    """Rank 1 of 3 dies at step 6 (checkpoints every 4 steps): 2 ranks go on from step 4, end where a run that never
    stopped ends, and torch.distributed.checkpoint's resharding of the same states gives what load() gave."""
    command = ["ft.py", "--world-size", "3", "--kill", "1@6", "--restart-on", "2", "--compare", "--niters", "10"]
    done = subprocess.run(
        [sys.executable, *command], cwd=SOLUTIONS, capture_output=True, text=True, timeout=300, env=os.environ
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "rank 1 killed at step 6: the others saw it in a collective" in out, out
    assert "restarted on 2 ranks from step 4" in out, out
    assert "loaded on 2: the ranks' shards at most 0.0e+00 from what load() gave" in out, out
    assert float(re.search(r"final parameters: (\S+) apart", out)[1]) < 1e-12, out
