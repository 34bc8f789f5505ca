"""Exercise 1: the MLP, its evaluation, and a training run on one process."""

import pytest
import torch
import torch.nn.functional as F

from course import impl
from tests.helpers import small_config


def check_layers(folder):
    mlp = impl.load(folder).mlp
    config = small_config(mlp)
    model = mlp.MLP(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    widths = [config.d_in, *[config.d_hidden] * (config.n_layers - 1), config.n_classes]
    expected = {f"layers.{i}.weight": (b, a) for i, (a, b) in enumerate(zip(widths, widths[1:]))}
    assert shapes == expected, f"the MLP's parameters should be {expected} (bias-free nn.Linear layers in self.layers), got {shapes}"


def check_forward(folder):
    mlp = impl.load(folder).mlp
    config = small_config(mlp)
    torch.manual_seed(0)
    model = mlp.MLP(config)
    x, y = torch.randn(5, config.d_in), torch.randint(0, config.n_classes, (5,))
    expected = x
    for i, layer in enumerate(model.layers):
        expected = expected @ layer.weight.T
        if i < len(model.layers) - 1:
            expected = torch.tanh(expected)
    logits, loss = model(x)
    assert loss is None, "forward(data) without targets should return (logits, None)"
    assert logits.shape == (5, config.n_classes), f"logits should have shape (batch, n_classes), got {tuple(logits.shape)}"
    assert torch.allclose(logits, expected, atol=1e-6), "logits are wrong: tanh goes between the layers and not after the last one"
    _, loss = model(x, y)
    assert torch.allclose(loss, F.cross_entropy(expected, y), atol=1e-6), "with targets, the loss should be the cross-entropy of the logits"


def check_evaluate(folder):
    mlp = impl.load(folder).mlp
    config = small_config(mlp)
    torch.manual_seed(0)
    model = mlp.MLP(config)
    X, Y = torch.randn(120, config.d_in), torch.randint(0, config.n_classes, (120,))
    with torch.no_grad():
        means = [F.cross_entropy(model(X[i : i + 50])[0], Y[i : i + 50]).item() for i in (0, 50, 100)]
    got = mlp.evaluate(model, (X, Y), batch_size=50)
    assert abs(got - sum(means) / 3) < 1e-5, f"evaluate should average the loss of each batch of 50: expected {sum(means) / 3:.5f}, got {got:.5f}"
    got = mlp.evaluate(model, (X, Y), batch_size=50, max_batches=2)
    assert abs(got - sum(means[:2]) / 2) < 1e-5, "evaluate should stop after max_batches batches"
    assert model.training, "evaluate should leave the model in training mode"
    assert all(p.grad is None for p in model.parameters()), "evaluate should not compute gradients (torch.no_grad)"


def check_dataset(folder):
    mlp = impl.load(folder).mlp
    config = small_config(mlp)
    X, Y = mlp.gen_dataset(config, rand_state=7)
    assert X.shape == (config.train_size, config.d_in) and X.dtype == torch.float32
    assert Y.shape == (config.train_size,) and Y.dtype == torch.int64
    X2, Y2 = mlp.gen_dataset(config, rand_state=7)
    assert torch.equal(X, X2) and torch.equal(Y, Y2), "gen_dataset must give the same data for the same rand_state"


def check_training(folder):
    """train() on one process learns, and its test loss is measured on the held-out 10%."""
    mlp = impl.load(folder).mlp
    config = small_config(mlp, niters=40)
    result = mlp.train(config)
    model = mlp.MLP(config)
    model.load_state_dict(result["state"])
    (_, _), (X_test, Y_test) = mlp.split_dataset(*mlp.gen_dataset(config, rand_state=config.seed))
    with torch.no_grad():
        held_out = F.cross_entropy(model(X_test)[0], Y_test).item()
    assert abs(result["test_loss"] - held_out) < 1e-4, (
        f"the reported test loss {result['test_loss']:.4f} is not the loss on the held-out rows ({held_out:.4f}):"
        " is it measured on the training data?"
    )
    first = mlp.train(small_config(mlp, niters=1))
    assert result["train_loss"] < first["train_loss"], "the training loss should fall over 40 steps"
    again = mlp.train(config)
    assert all(torch.equal(result["state"][k], again["state"][k]) for k in result["state"]), "training should be reproducible for a fixed seed"


def check_step_lines(folder, capsys):
    mlp = impl.load(folder).mlp
    mlp.train(small_config(mlp, niters=101))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 0", "step 100"], "train should print a line every 100 steps"
    import re

    pattern = r"step \d+ \| train_loss \d+\.\d{4} \| test_loss \d+\.\d{4} \| step time \d+\.\d{2}ms"
    assert all(re.fullmatch(pattern, line) for line in lines), f"step lines should look like 'step N | train_loss X.XXXX | test_loss Y.YYYY | step time Z.ZZms', got {lines}"


def check_cli_types(folder):
    mlp = impl.load(folder).mlp
    args = mlp.make_parser().parse_args(["--batch-size", "32", "--dim-in", "8", "--learning-rate", "0.5", "--world-size", "2"])
    config = mlp.config_from(args)
    assert isinstance(config.batch_size, int) and isinstance(config.d_in, int) and config.lr == 0.5


def test_layers(impl_dir):
    check_layers(impl_dir)


def test_forward(impl_dir):
    check_forward(impl_dir)


def test_evaluate(impl_dir):
    check_evaluate(impl_dir)


@pytest.mark.scaffold
def test_dataset(impl_dir):
    check_dataset(impl_dir)


def test_training(impl_dir):
    check_training(impl_dir)


def test_step_lines(impl_dir, capsys):
    check_step_lines(impl_dir, capsys)


@pytest.mark.scaffold
def test_cli_types(impl_dir):
    check_cli_types(impl_dir)
