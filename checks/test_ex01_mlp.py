"""Exercise 1: the MLP, its evaluation, and a training run on one process."""

import re

import pytest
import torch
import torch.nn.functional as F

from checks.contracts import check_contracts
from checks.helpers import CONFIG, WIDTHS, SmallMLP, alone, forward_from, keyed, load, many, printed, small_config
from course.grading.points import said


def build(folder, seed=0):
    mlp = load(folder).mlp
    torch.manual_seed(seed)
    return mlp, mlp.MLP(small_config(mlp))


def weights_of(model):
    return [layer.weight.detach().clone() for layer in model.layers]


def layer_shapes(folder):
    _, model = build(folder)
    return {name: list(p.shape) for name, p in model.named_parameters()}


def check_layers(folder):
    """The MLP's parameters are bias-free nn.Linear layers of exercise 1's widths, in self.layers."""
    shapes = {name: tuple(shape) for name, shape in alone(layer_shapes, folder, expect=keyed(many(int))).items()}
    expected = {f"layers.{i}.weight": (b, a) for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:]))}
    assert shapes == expected, (
        f"the MLP's parameters should be {expected} (bias-free nn.Linear layers in self.layers), got {shapes}"
    )


def sample(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, CONFIG.d_in, generator=g), torch.randint(0, CONFIG.n_classes, (rows,), generator=g)


def forward_both_ways(folder, x, y):
    _, model = build(folder)
    logits, loss = model(x)
    return {
        "parameters": [name for name, _ in model.named_parameters()],
        "weights": weights_of(model),
        "logits": logits.detach(),
        "no_loss": loss is None,
        "loss_with_targets": model(x, y)[1].detach(),
    }


FORWARD = {
    "parameters": many(str),
    "weights": many(torch.Tensor),
    "logits": torch.Tensor,
    "no_loss": bool,
    "loss_with_targets": torch.Tensor,
}


def wrong_activation(weights, x, logits):
    """Why the logits are wrong: the one way of placing an activation that gives them, or the fact that
    none does, with its concept (course/grading/points.py)."""

    def through(activation, after_last=False):
        out = x
        for i, weight in enumerate(weights):
            out = out @ weight.T
            if i < len(weights) - 1 or after_last:
                out = activation(out)
        return out

    ways = {
        "tanh after the last layer too: the logits are the last layer's output as it is": through(torch.tanh, True),
        "no tanh between the layers": through(lambda t: t),
        "relu between the layers where tanh is asked": through(torch.relu),
    }
    found = next((why for why, out in ways.items() if torch.allclose(logits, out, atol=1e-6)), None)
    if found:
        return said(found.split(":")[0], f"logits are wrong: {found}")
    return said(
        "logits not the layers applied in order with tanh between them",
        "logits are wrong: they are not the layers' weights applied in order with tanh between them",
    )


def check_forward(folder):
    """forward gives (logits, None) without targets, the logits of the layers with tanh between them,
    and with targets the cross-entropy of the logits."""
    x, y = sample(5, 0)
    got = alone(forward_both_ways, folder, x, y, expect=FORWARD)
    expected = forward_from(got["weights"], x)
    assert got["no_loss"] is True, said(
        "a loss without targets", "forward(data) without targets should return (logits, None)"
    )
    logits = got["logits"]
    assert logits.shape == (5, CONFIG.n_classes), said(
        "logits of the wrong shape", f"logits should have shape (batch, n_classes), got {tuple(logits.shape)}"
    )
    extra = [name for name in got["parameters"] if not re.fullmatch(r"layers\.\d+\.weight", name)]
    assert not extra, said(
        "layers with a bias",
        f"the layers hold {', '.join(extra)}: the MLP's nn.Linear layers are bias-free (bias=False),"
        " so the logits come from the weights alone",
    )
    assert torch.allclose(logits, expected, atol=1e-6), wrong_activation(got["weights"], x, logits)
    assert torch.allclose(got["loss_with_targets"], F.cross_entropy(expected, y), atol=1e-6), said(
        "the loss not the cross-entropy of the logits",
        "with targets, the loss should be the cross-entropy of the logits",
    )


def evaluate_twice(folder, X, Y):
    """Probe: evaluate on the tests' own MLP (the student's has checks of its own)."""
    mlp = load(folder).mlp
    torch.manual_seed(0)
    model = SmallMLP()
    weights = weights_of(model)
    full = float(mlp.evaluate(model, (X, Y), batch_size=50))
    first_two = float(mlp.evaluate(model, (X, Y), batch_size=50, max_batches=2))
    no_grads = all(p.grad is None for p in model.parameters())
    return {"weights": weights, "full": full, "first_two": first_two, "training": model.training, "no_grads": no_grads}


EVALUATED = {"weights": many(torch.Tensor), "full": float, "first_two": float, "training": bool, "no_grads": bool}


def check_evaluate(folder):
    """evaluate averages the loss of each batch, up to max_batches, without gradients, in training mode after."""
    X, Y = sample(120, 1)
    got = alone(evaluate_twice, folder, X, Y, expect=EVALUATED)
    means = [F.cross_entropy(forward_from(got["weights"], X[i : i + 50]), Y[i : i + 50]).item() for i in (0, 50, 100)]
    assert abs(got["full"] - sum(means) / 3) < 1e-5, said(
        "evaluate not the mean of the batches' losses",
        f"evaluate should average the loss of each batch of 50: expected {sum(means) / 3:.5f}, got {got['full']:.5f}",
    )
    assert abs(got["first_two"] - sum(means[:2]) / 2) < 1e-5, said(
        "evaluate ignores max_batches", "evaluate should stop after max_batches batches"
    )
    assert got["training"] is True, said(
        "evaluate leaves the model in eval mode", "evaluate should leave the model in training mode"
    )
    assert got["no_grads"] is True, said(
        "evaluate computes gradients", "evaluate should not compute gradients (torch.no_grad)"
    )


def make_dataset(folder):
    mlp = load(folder).mlp
    config = small_config(mlp)
    return [mlp.gen_dataset(config, rand_state=7), mlp.gen_dataset(config, rand_state=7)]


def check_dataset(folder):
    """gen_dataset gives float32 rows and int64 labels of the config's sizes, the same for the same rand_state."""
    (X, Y), (X2, Y2) = alone(make_dataset, folder, expect=((torch.Tensor, torch.Tensor),) * 2)
    assert X.shape == (CONFIG.train_size, CONFIG.d_in) and X.dtype == torch.float32, said(
        "rows not float32 of the config's sizes",
        f"gen_dataset gave rows of shape {tuple(X.shape)} and dtype {X.dtype}: float32 rows of shape"
        f" ({CONFIG.train_size}, {CONFIG.d_in}), the config's train_size by d_in",
    )
    assert Y.shape == (CONFIG.train_size,) and Y.dtype == torch.int64, said(
        "labels not int64 of the config's size",
        f"gen_dataset gave labels of shape {tuple(Y.shape)} and dtype {Y.dtype}: int64 labels of shape"
        f" ({CONFIG.train_size},), one per row",
    )
    assert torch.equal(X, X2) and torch.equal(Y, Y2), said(
        "data not the same for the same rand_state", "gen_dataset must give the same data for the same rand_state"
    )


def train_three_times(folder):
    """40 steps, 1 step, and 40 steps again; and the held-out rows, as the given code splits them."""
    mlp = load(folder).mlp
    config = small_config(mlp, niters=40)
    runs = [mlp.train(config), mlp.train(small_config(mlp, niters=1)), mlp.train(config)]
    (_, _), (X_test, Y_test) = mlp.split_dataset(*mlp.gen_dataset(config, rand_state=config.seed))
    figures = [
        {"train_loss": float(r["train_loss"]), "test_loss": float(r["test_loss"]), "state": r["state"]} for r in runs
    ]
    return {"runs": figures, "X_test": X_test, "Y_test": Y_test}


RUN = {"train_loss": float, "test_loss": float, "state": keyed(torch.Tensor)}
TRAINED = {"runs": (RUN,) * 3, "X_test": torch.Tensor, "Y_test": torch.Tensor}


def check_training(folder):
    """train() on one process learns, and its test loss is measured on the held-out 10%."""
    got = alone(train_three_times, folder, expect=TRAINED)
    result, first, again = got["runs"]
    held_out = F.cross_entropy(forward_from(list(result["state"].values()), got["X_test"]), got["Y_test"]).item()
    assert abs(result["test_loss"] - held_out) < 1e-4, said(
        "the test loss not measured on the held-out rows",
        f"the reported test loss {result['test_loss']:.4f} is not the loss on the held-out rows ({held_out:.4f}):"
        " is it measured on the training data?",
    )
    assert result["train_loss"] < first["train_loss"], said(
        "a training loss that does not fall", "the training loss should fall over 40 steps"
    )
    assert result["state"].keys() == again["state"].keys() and all(
        torch.equal(result["state"][k], again["state"][k]) for k in result["state"]
    ), said("training not reproducible for a fixed seed", "training should be reproducible for a fixed seed")


def train_printing(folder):
    mlp = load(folder).mlp
    return printed(mlp.train, small_config(mlp, niters=101))[1]


def check_step_lines(folder):
    """train prints a step line every 100 steps, in the handout's format."""
    lines = [line for line in alone(train_printing, folder, expect=str).splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 0", "step 100"], said(
        "step lines not every 100 steps", "train should print a line every 100 steps"
    )
    pattern = r"step \d+ \| train_loss \d+\.\d{4} \| test_loss \d+\.\d{4} \| step time \d+\.\d{2}ms"
    assert all(re.fullmatch(pattern, line) for line in lines), said(
        "step lines not in the handout's format",
        f"step lines should look like 'step N | train_loss X.XXXX | test_loss Y.YYYY | step time Z.ZZms', got {lines}",
    )


def parse_cli(folder):
    mlp = load(folder).mlp
    config = mlp.config_from(
        mlp.make_parser().parse_args(
            ["--batch-size", "32", "--dim-in", "8", "--learning-rate", "0.5", "--world-size", "2"]
        )
    )
    return {"batch_size": config.batch_size, "d_in": config.d_in, "lr": config.lr}


def check_cli_types(folder):
    """The command line's numbers reach the config as an int or a float, as ModelConfig types them."""
    got = alone(parse_cli, folder, expect={"batch_size": object, "d_in": object, "lr": object})
    assert isinstance(got["batch_size"], int) and isinstance(got["d_in"], int) and got["lr"] == 0.5


@pytest.mark.points(4)
def test_layers(impl_dir):
    check_layers(impl_dir)


@pytest.mark.points(4)
def test_forward(impl_dir):
    check_forward(impl_dir)


@pytest.mark.points(4)
def test_evaluate(impl_dir):
    check_evaluate(impl_dir)


@pytest.mark.scaffold
def test_dataset(impl_dir):
    check_dataset(impl_dir)


@pytest.mark.points(5)
def test_training(impl_dir):
    check_training(impl_dir)


@pytest.mark.points(2)
def test_step_lines(impl_dir):
    check_step_lines(impl_dir)


@pytest.mark.scaffold
def test_cli_types(impl_dir):
    check_cli_types(impl_dir)


@pytest.mark.points(1)
def test_contracts(impl_dir):
    """Every promise declared for the exercise's functions in checks/contracts.py: evaluate returns a float."""
    check_contracts(impl_dir, 1)
