"""The checks of exercise 1 catch the mistakes of an MLP's layers, forward and evaluation.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
mistake and shows that the check for it fails, with a message that points at the mistake.
"""

import pytest

from checks.test_ex01_mlp import check_forward, check_training
from tests.mutants import assert_caught

MUTANTS = {
    "layers with a bias": (
        "mlp.py",
        "nn.Linear(a, b, bias=False)",
        "nn.Linear(a, b)",
        check_forward,
        "the layers hold layers.0.bias, layers.1.bias, layers.2.bias: the MLP's nn.Linear layers are bias-free",
    ),
    "tanh after the last layer too": (
        "mlp.py",
        "            if i < len(self.layers) - 1:\n                x = torch.tanh(x)",
        "            x = torch.tanh(x)",
        check_forward,
        "logits are wrong: tanh after the last layer too",
    ),
    "test loss computed on training data": (
        "mlp.py",
        '"test_loss": evaluate(model, test_set),',
        '"test_loss": evaluate(model, train_set),',
        check_training,
        "measured on the training data",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])
