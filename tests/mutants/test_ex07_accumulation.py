"""The checks of exercise 7 catch the classic mistakes of gradient accumulation.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
mistake and shows that the check for it fails, with a message that points at the mistake.
"""

import pytest

from checks.test_ex07_accumulation import check_accumulation_step, check_nested_no_sync, check_no_sync_accumulates
from tests.mutants import assert_caught

MUTANTS = {
    "tensor hook instead of post-accumulate hook": (
        "mydp.py",
        "param.register_post_accumulate_grad_hook(partial(self._gradient_ready, bucket))",
        "param.register_hook(lambda grad, param=param, bucket=bucket: self._gradient_ready(bucket, param))",
        check_no_sync_accumulates,
        "register_post_accumulate_grad_hook",
    ),
    "no_sync still all-reduces": (
        "mydp.py",
        "        if not self.require_backward_grad_sync:\n            return",
        "        if False:\n            return",
        check_no_sync_accumulates,
        "inside no_sync()",
    ),
    "no_sync turns synchronisation on at its end": (
        "mydp.py",
        "self.require_backward_grad_sync = previous",
        "self.require_backward_grad_sync = True",
        check_nested_no_sync,
        "previous value",
    ),
    "micro-batch loss not divided by their number": (
        "mydp.py",
        "(loss / micro_batches).backward()",
        "loss.backward()",
        check_accumulation_step,
        "divided by the number of micro-batches",
    ),
    "no_sync gives the flag back only when the block ends normally": (
        "mydp.py",
        "        try:\n            yield\n        finally:\n            self.require_backward_grad_sync = previous",
        "        yield\n        self.require_backward_grad_sync = previous",
        check_nested_no_sync,
        "even when the block raises",
    ),
    "every micro-batch inside no_sync": (
        "mydp.py",
        "with model.no_sync() if i < len(pieces) - 1 else nullcontext():",
        "with model.no_sync():",
        check_accumulation_step,
        "the last micro-batch's backward pass must run outside no_sync()",
    ),
    "no micro-batch inside no_sync": (
        "mydp.py",
        "with model.no_sync() if i < len(pieces) - 1 else nullcontext():",
        "with nullcontext():",
        check_accumulation_step,
        "run the other micro-batches inside model.no_sync()",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])
