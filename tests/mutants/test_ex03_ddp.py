"""The checks of exercise 3 catch the mistakes of sharing batches under built-in DDP.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
mistake and shows that the check for it fails, with a message that points at the mistake.
"""

import pytest

from checks.test_ex03_ddp import check_ddp_steps, check_train_shares_batches
from tests.mutants import assert_caught

MUTANTS = {
    # DDP without its broadcast at the start: the ranks' models, built apart, stay apart.
    "DDP told not to sync the ranks at the start": (
        "mlp.py",
        "return DDP(model, device_ids=ddp_device_ids(model))",
        "return DDP(model, device_ids=ddp_device_ids(model), init_sync=False)",
        lambda folder: check_ddp_steps(folder, 2),
        "unless it is told not to (init_sync=False)",
    ),
    "DDP told not to sync the ranks at the start, as train shows it": (
        "mlp.py",
        "return DDP(model, device_ids=ddp_device_ids(model))",
        "return DDP(model, device_ids=ddp_device_ids(model), init_sync=False)",
        check_train_shares_batches,
        "does every rank start from rank 0's parameters",
    ),
    "every rank trains on the same batches": (
        "mlp.py",
        "if i % world_size != rank:",
        "if False:",
        check_train_shares_batches,
        "i % world_size == r",
    ),
    "every rank trains on the batches of the others": (
        "mlp.py",
        "if i % world_size != rank:",
        "if i % world_size == rank:",
        lambda folder: check_train_shares_batches(folder, 3),
        "after training on 3 ranks",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])
