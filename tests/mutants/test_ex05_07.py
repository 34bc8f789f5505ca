"""The checks of exercises 5 to 7 catch the classic mistakes of ring all-reduce, overlap, buckets
and accumulation, which a check of final numbers alone lets through.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
mistake and shows that the check for it fails, with a message that points at the mistake.
"""

import pytest

from checks.helpers import check_start_sync
from checks.test_ex05_ring import check_ring
from checks.test_ex06_overlap import check_bucket_order, check_overlap, check_shared_parameters
from checks.test_ex07_accumulation import check_accumulation_step, check_nested_no_sync, check_no_sync_accumulates
from tests.mutants import assert_caught

WAIT_IN_ORDER = """        while self.launched < len(self.buckets):
            waiting = self.buckets[self.launched]
            if waiting.ready < len(waiting.params):
                break
            self._launch(waiting)
            self.launched += 1
"""
LAUNCH_WHEN_FULL = """        if bucket.ready == len(bucket.params):
            self._launch(bucket)
            self.launched += 1
"""

MUTANTS = {
    "OverlappedDP starts from each rank's own weights": (
        "mydp.py",
        "        with torch.no_grad():\n            for state in [*model.parameters(), *model.buffers()]:\n"
        "                dist.broadcast(state, src=0)\n",
        "",
        lambda folder: check_start_sync(folder, 2, "overlapped"),
        "broadcast parameters and buffers from rank 0",
    ),
    # With 2 ranks the sums are right, but each step moves the whole tensor, not half of it.
    "ring sends the whole tensor at every step": (
        "dist.py",
        "chunks = tensor.view(-1).tensor_split(world_size)",
        "chunks = [tensor.view(-1)] * world_size",
        lambda folder: check_ring(folder, 2),
        "send one chunk per step",
    ),
    "ring calls dist.all_reduce": (
        "dist.py",
        "    # Rank r now holds the complete sum",
        "    return dist.all_reduce(tensor)\n    # Rank r now holds the complete sum",
        lambda folder: check_ring(folder, 2),
        "no collective",
    ),
    # gloo drops a send whose request is freed before it ends: its peer waits for ever, in the right order.
    "exchange never waits for its send": (
        "dist.py",
        "    for request in requests:\n        request.wait()\n",
        "    requests[1].wait()\n",
        lambda folder: check_ring(folder, 2),
        "never waited for",
    ),
    # Right numbers, no overlap: each bucket's all-reduce ends before autograd goes on.
    "hook waits for its all-reduce": (
        "mydp.py",
        "bucket.work = dist.all_reduce(bucket.buffer, async_op=True)",
        "bucket.work = dist.all_reduce(bucket.buffer, async_op=True)\n        bucket.work.wait()",
        check_overlap,
        "none overlapped the backward pass",
    ),
    # The first layer's gradient, ready last, is in the first bucket: nothing can start early.
    "buckets filled in registration order": (
        "mydp.py",
        "for param in reversed(params):",
        "for param in params:",
        check_overlap,
        "fill buckets last parameter first",
    ),
    # A weight shared by two layers is listed, bucketed and hooked once per layer.
    "hook fires twice for a parameter used twice": (
        "mydp.py",
        "params = [p for p in model.parameters() if p.requires_grad]",
        "params = [p for m in model.modules() for p in m.parameters(recurse=False) if p.requires_grad]",
        check_shared_parameters,
        "fire twice",
    ),
    # A tensor hook runs before .grad is written: it reads last pass's or the no_sync() gradient.
    "tensor hook instead of post-accumulate hook": (
        "mydp.py",
        "param.register_post_accumulate_grad_hook(partial(self._gradient_ready, bucket))",
        "param.register_hook(lambda grad, param=param, bucket=bucket: self._gradient_ready(bucket, param))",
        check_no_sync_accumulates,
        "register_post_accumulate_grad_hook",
    ),
    "bucket counts not reset after a backward pass": (
        "mydp.py",
        "bucket.ready, bucket.work = 0, None",
        "bucket.work = None",
        check_overlap,
        "reset the counts in finish_gradient_synchronization",
    ),
    "launched count not reset after a backward pass": (
        "mydp.py",
        "self.launched, self.finish_queued = 0, False",
        "self.finish_queued = False",
        check_overlap,
        "'self.launched': 3",
    ),
    "buckets launched in the order they fill": (
        "mydp.py",
        WAIT_IN_ORDER,
        LAUNCH_WHEN_FULL,
        check_bucket_order,
        "in bucket order",
    ),
    # Right numbers (averaging is linear), but every micro-batch pays a full all-reduce.
    "no_sync still all-reduces": (
        "mydp.py",
        "        if not self.require_backward_grad_sync:\n            return",
        "        if False:\n            return",
        check_no_sync_accumulates,
        "inside no_sync()",
    ),
    # Right for one block; a nested block's end turns synchronisation on inside the outer one.
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
