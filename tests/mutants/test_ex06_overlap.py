"""The checks of exercise 6 catch the classic mistakes of overlap and buckets, which a check of final
numbers alone lets through.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
mistake and shows that the check for it fails, with a message that points at the mistake.
"""

import pytest

from checks.helpers import check_start_sync
from checks.test_ex06_overlap import check_bucket_order, check_overlap, check_shared_parameters, test_overlapped_steps
from tests.mutants import assert_caught, assert_torch_own_caught

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
    "a new buffer every step": (
        "mydp.py",
        "        torch.cat([p.grad.reshape(-1) for p in bucket.params], out=bucket.buffer)\n",
        "        bucket.buffer = torch.cat([p.grad.reshape(-1) for p in bucket.params])\n",
        check_overlap,
        "a bucket's all-reduce goes through bucket.buffer, in place",
    ),
    "the all-reduce of a copy of the buffer": (
        "mydp.py",
        "bucket.work = dist.all_reduce(bucket.buffer, async_op=True)",
        "bucket.work = dist.all_reduce(bucket.buffer.clone(), async_op=True)",
        check_overlap,
        "no all-reduce went through the buffer of bucket 0",
    ),
    "the .grad tensors made views of the bucket's buffer": (
        "mydp.py",
        "                param.grad.copy_(average.view_as(param.grad))\n",
        "                param.grad = average.view_as(param.grad)\n",
        check_overlap,
        "the .grad tensors share memory with a bucket's buffer",
    ),
    "OverlappedDP starts from each rank's own weights": (
        "mydp.py",
        "        with torch.no_grad():\n            for state in [*model.parameters(), *model.buffers()]:\n"
        "                dist.broadcast(state, src=0)\n",
        "",
        lambda folder: check_start_sync(folder, 2, "overlapped"),
        "broadcast parameters and buffers from rank 0",
    ),
    "hook waits for its all-reduce": (
        "mydp.py",
        "bucket.work = dist.all_reduce(bucket.buffer, async_op=True)",
        "bucket.work = dist.all_reduce(bucket.buffer, async_op=True)\n        bucket.work.wait()",
        check_overlap,
        "none overlapped the backward pass",
    ),
    "buckets filled in registration order": (
        "mydp.py",
        "for param in reversed(params):",
        "for param in params:",
        check_overlap,
        "fill buckets last parameter first",
    ),
    "hook fires twice for a parameter used twice": (
        "mydp.py",
        "params = [p for p in model.parameters() if p.requires_grad]",
        "params = [p for m in model.modules() for p in m.parameters(recurse=False) if p.requires_grad]",
        check_shared_parameters,
        "fire twice",
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
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])


# Issue 47: an OverlappedDP that is torch's DDP, with its buckets, computes what OverlappedDP must; the kernel's
# count of its Reducer tells.
TORCH_OWN = (
    "mydp.py",
    "        with torch.no_grad():\n"
    "            for state in [*model.parameters(), *model.buffers()]:\n"
    "                dist.broadcast(state, src=0)\n"
    "        for bucket in self.buckets:\n"
    "            for param in bucket.params:\n"
    "                param.register_post_accumulate_grad_hook(partial(self._gradient_ready, bucket))\n",
    "        self.module = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)\n",
    lambda folder: test_overlapped_steps(folder, "bucketed", 2),
    "DistributedDataParallel",
)


def test_torch_own_ddp_is_caught(tmp_path, monkeypatch):
    assert_torch_own_caught(tmp_path / "mutant", "OverlappedDP as torch's DDP", *TORCH_OWN, monkeypatch)
