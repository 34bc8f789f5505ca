# Your copy of the exercise code: fill in every TODO, then `make grade` checks it.
"""Exercise 15: pipeline parallelism, GPipe then 1F1B, from point-to-point messages.

    python pp.py --world-size 2 --schedule 1f1b     # the MLP trained on a pipeline of 2 stages
    python pp.py --world-size 2 --timeline pp.svg --dim-in 512 --dim-hidden 1024 --n-layers 8 --batch-size 256 \
        --micro-batches 8                           # one step of each schedule, drawn stage by stage

In exercises 3 to 11 every rank holds the whole model. Here each rank holds a stage: a run of
consecutive layers. A batch is cut into m micro-batches. For each one, stage s receives the
activation from stage s - 1, runs its layers and sends the result on to stage s + 1; later it
receives the gradient of that result from stage s + 1 and sends the gradient of its input back to
stage s - 1. A schedule is the order in which each stage runs its forwards and backwards.

Handout: exercises/15_pp.md.
"""

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course import timeline
from course.device import current_device
from course.launch import launch, launch_options
from mlp import MLP, ModelConfig, batches, config_from, evaluate, gen_dataset, make_parser, split_dataset

# Part A: the messages between neighbouring stages.


def communicate(sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]]) -> None:
    """Start every send (tensor, to rank) and every receive (into tensor, from rank) at once, then wait for all.

    A schedule calls it once per event, with the previous event's result to send and this event's
    input to receive: started together, the two never wait for each other. One
    dist.batch_isend_irecv of dist.P2POp's (on NCCL a step's sends and receives must start
    together, as in exercise 5). No message says its shape: the receiver made its tensor already.
    """
    # TODO(exercise 15): every send and receive started, then every one waited for.
    raise NotImplementedError("Exercise 15: communicate is not written yet, see exercises/15_pp.md")


def to_receive(kind: str, shape: tuple[int, ...]) -> list[tuple[torch.Tensor, int]]:
    """What event `kind` of this rank receives, as [(a new tensor of the agreed shape, from rank)].

    A forward ("F") receives an activation from the stage before, rank - 1; a backward ("B") the
    gradient of its output from the stage after, rank + 1. The first stage's forwards read the
    batch and the last stage's backwards start from its loss: they receive nothing ([]).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # TODO(exercise 15): one receive, or none at the two ends of the pipeline.
    raise NotImplementedError("Exercise 15: to_receive is not written yet, see exercises/15_pp.md")


# Part B: the stages, and the micro-batches' loss.


def stage_layers(n_layers: int, world_size: int) -> list[range]:
    """The layers of each stage: stage s holds the s-th of world_size runs of consecutive layers.

    The runs are as even as possible, the first n_layers % world_size of them one layer longer:
    stage_layers(6, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]. Every layer is
    in exactly one stage, in order.
    """
    if n_layers < world_size:
        raise ValueError(f"{n_layers} layers cannot give each of {world_size} stages one")
    # TODO(exercise 15): world_size ranges that cover range(n_layers) without overlapping.
    raise NotImplementedError("Exercise 15: stage_layers is not written yet, see exercises/15_pp.md")


class Stage(nn.Module):
    """The layers `layers` of the MLP `model`, with exercise 1's tanh after each but the model's last.

    Every rank builds the same whole MLP (the same seed) and keeps its own stage's layers.
    """

    def __init__(self, model: MLP, layers: range) -> None:
        super().__init__()
        self.layers = nn.ModuleList(model.layers[k] for k in layers)
        self.ends_model = layers.stop == len(model.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, layer in enumerate(self.layers):
            x = layer(x)
            if not (self.ends_model and k == len(self.layers) - 1):
                x = torch.tanh(x)
        return x


def micro_batch_loss(logits: torch.Tensor, targets: torch.Tensor, m: int) -> torch.Tensor:
    """The loss of one of m equal micro-batches, scaled so that the gradients of the m backwards
    add up to the gradient of the whole batch's mean cross-entropy (F.cross_entropy)."""
    # TODO(exercise 15): one line.
    raise NotImplementedError("Exercise 15: micro_batch_loss is not written yet, see exercises/15_pp.md")


# Part C: the schedules, each a list of events: ("F", i) is micro-batch i's forward, ("B", i) its backward.


def gpipe(m: int, p: int, s: int) -> list[tuple[str, int]]:
    """GPipe's events on stage s of p: the m forwards in order, then the m backwards in reverse
    order, the last micro-batch's first. Every stage keeps all m micro-batches' activations."""
    # TODO(exercise 15): gpipe(3, 2, 0) == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]
    raise NotImplementedError("Exercise 15: gpipe is not written yet, see exercises/15_pp.md")


def one_f_one_b(m: int, p: int, s: int) -> list[tuple[str, int]]:
    """1F1B's events on stage s of p: warm-up forwards, then one forward and one backward in turn,
    then the backwards left (the cool-down). Backwards run in micro-batch order, each as early as
    the stages after allow, so stage s keeps at most p - s micro-batches' activations at once."""
    # TODO(exercise 15): how many warm-up forwards before stage s's first backward? (m may be < p.)
    raise NotImplementedError("Exercise 15: one_f_one_b is not written yet, see exercises/15_pp.md")


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


class Pipeline:
    """One batch through this rank's stage, micro-batch by micro-batch, in the order of a schedule.

    Pipeline(stage, m, shape).run(events, x, y): x is the batch's input on the first stage, y its
    targets on the last (None elsewhere), both cut into m equal micro-batches. Every message,
    activation or gradient, is one micro-batch of shape `shape`, agreed in advance. The gradients
    add up in the stage's parameters' .grad; the optimizer steps after run.
    """

    def __init__(self, stage: nn.Module, m: int, shape: tuple[int, ...]) -> None:
        self.stage, self.m, self.shape = stage, m, shape
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.kept: dict = {}  # micro-batch i -> (its input, its output or loss): what its backward needs
        self.loss = 0.0

    def forward(self, i: int, x: torch.Tensor | None, y: torch.Tensor | None, received: torch.Tensor | None) -> list:
        """Micro-batch i's forward: its input is x on the first stage, the received activation
        elsewhere; run the stage; on the last stage compute its loss (micro_batch_loss) and add its
        value, a float, to self.loss. Keep what its backward needs; return the sends: [(output, to
        the next stage)], none from the last stage."""
        # TODO(exercise 15): the backward will need the input's gradient, so the input must ask for one.
        raise NotImplementedError("Exercise 15: Pipeline.forward is not written yet, see exercises/15_pp.md")

    def backward(self, i: int, received: torch.Tensor | None) -> list:
        """Micro-batch i's backward: from its loss on the last stage, from the received gradient of
        its output elsewhere; return the sends: [(its input's gradient, to the stage before)], none
        from the first stage. Nothing of micro-batch i is kept after it."""
        # TODO(exercise 15): backward through what forward(i) kept.
        raise NotImplementedError("Exercise 15: Pipeline.backward is not written yet, see exercises/15_pp.md")

    def run(self, events: list[tuple[str, int]], x: torch.Tensor | None, y: torch.Tensor | None) -> float | None:
        """Run the events; the batch's loss on the last stage, None on the others."""
        whole = x if x is not None else y
        if whole is not None and whole.shape[0] % self.m:
            raise ValueError(f"a batch of {whole.shape[0]} rows does not cut into {self.m} equal micro-batches")
        xs = x.tensor_split(self.m) if x is not None else [None] * self.m
        ys = y.tensor_split(self.m) if y is not None else [None] * self.m
        sends = []
        for kind, i in events:
            receive = to_receive(kind, self.shape)
            communicate(sends, receive)  # the last event's result leaves while this one's input arrives
            received = receive[0][0] if receive else None
            sends = self.forward(i, xs[i], ys[i], received) if kind == "F" else self.backward(i, received)
        communicate(sends, [])
        return self.loss if self.rank == self.world_size - 1 else None


# The script: train the MLP on a pipeline, and compare with one process.


def pipeline_of(config: ModelConfig) -> tuple[MLP, Stage]:
    """The whole MLP, the same on every rank, and this rank's stage of it."""
    torch.manual_seed(config.seed)
    model = MLP(config).to(current_device())
    return model, Stage(model, stage_layers(config.n_layers, dist.get_world_size())[dist.get_rank()])


def ends(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The batch as this rank sees it: the inputs on the first stage, the targets on the last."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return (x if rank == 0 else None), (y if rank == world_size - 1 else None)


def train(config: ModelConfig, schedule: str = "1f1b", m: int = 4) -> dict:
    """Train the MLP on a pipeline of dist.get_world_size() stages; the final figures, and the whole
    trained model's state (every stage's layers) on every rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = current_device()
    train_set, test_set = split_dataset(*(t.to(device) for t in gen_dataset(config, rand_state=config.seed)))
    model, stage = pipeline_of(config)
    optimizer = torch.optim.SGD(stage.parameters(), lr=config.lr)
    events = SCHEDULES[schedule](m, world_size, rank)
    shape = (config.batch_size // m, config.d_hidden)
    step_times, loss = [], None
    for step, (_, x, y) in enumerate(batches(*train_set, config.batch_size, config.seed)):
        if step == config.niters:
            break
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss = Pipeline(stage, m, shape).run(events, *ends(x, y))
        optimizer.step()
        step_times.append((time.perf_counter() - t0) * 1000)
        if loss is not None and step % 100 == 0:
            print(f"step {step} | train_loss {loss:.4f} (stage {rank} of {world_size}, {schedule}, m={m})")
    # Every stage's trained layers, in one model on every rank.
    layers = {k: model.layers[k].weight.detach().cpu() for k in stage_layers(config.n_layers, world_size)[rank]}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, layers)
    with torch.no_grad():
        for mine in everyone:
            for k, weight in mine.items():
                model.layers[k].weight.copy_(weight)
    return {
        "train_loss": loss,
        "test_loss": evaluate(model, test_set),
        "step_ms": statistics.median(step_times),
        "state": {k: v.detach().cpu() for k, v in model.state_dict().items()},
    }


def one_process(config: ModelConfig) -> dict:
    """The same training in this process alone, on the CPU: the whole MLP on the whole batches."""
    train_set, test_set = split_dataset(*gen_dataset(config, rand_state=config.seed))
    torch.manual_seed(config.seed)
    model = MLP(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    for step, (_, x, y) in enumerate(batches(*train_set, config.batch_size, config.seed)):
        if step == config.niters:
            break
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()
    return {"test_loss": evaluate(model, test_set), "state": model.state_dict()}


def record_step(config: ModelConfig, schedule: str, m: int, warmup: int = 3) -> list:
    """Run on every rank: a few steps to warm up, then one step recorded: each forward and each
    backward of this rank's stage as a span, in seconds from a start that every rank shares."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _, stage = pipeline_of(config)
    x, y = gen_dataset(config, rand_state=config.seed)
    x, y = x[: config.batch_size].to(current_device()), y[: config.batch_size].to(current_device())
    events = SCHEDULES[schedule](m, world_size, rank)
    shape = (config.batch_size // m, config.d_hidden)
    for _ in range(warmup):
        Pipeline(stage, m, shape).run(events, *ends(x, y))
    pipeline = Pipeline(stage, m, shape)
    spans = timeline.Spans()
    pipeline.forward = spans.timed(pipeline.forward, "forward", "F")
    pipeline.backward = spans.timed(pipeline.backward, "backward", "B")
    dist.barrier()  # the ranks start the recorded step together
    spans.restart()
    pipeline.run(events, *ends(x, y))
    return spans.events


def bubble(p: int, m: int) -> float:
    """The idle fraction of every stage when forward and backward take the same time on every stage
    and messages take none: (p - 1) / (m + p - 1)."""
    return (p - 1) / (m + p - 1)


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--micro-batches", type=int, default=4, help="m: micro-batches per batch")
    parser.add_argument("--timeline", metavar="FILE.svg", help="draw one step of GPipe and of 1F1B on every stage")
    parser.set_defaults(world_size=2)
    args = parser.parse_args()
    if args.micro_batches < 1:
        parser.error(f"--micro-batches {args.micro_batches}: a batch splits into 1 micro-batch or more")
    if args.n_layers < args.world_size:
        parser.error(f"--n-layers {args.n_layers} cannot give each of --world-size {args.world_size} stages a layer")
    config = config_from(args)
    if args.timeline:
        traces = {
            name: launch(record_step, args.world_size, config, name, args.micro_batches, **launch_options(args))
            for name in SCHEDULES
        }
        for name, runs in traces.items():
            idle = ", ".join(f"{fraction:.2f}" for fraction in timeline.idle_fractions(runs))
            print(
                f"{name}: idle fraction by stage {idle}; (p - 1)/(m + p - 1) = "
                f"{bubble(args.world_size, args.micro_batches):.2f}"
            )
        title = f"one step on {args.world_size} stages, m = {args.micro_batches} micro-batches"
        timeline.write(args.timeline, traces, title, lanes=timeline.PIPELINE_LANES)
        print(f"wrote {args.timeline}")
    else:
        last = launch(train, args.world_size, config, args.schedule, args.micro_batches, **launch_options(args))[-1]
        alone = one_process(config)
        difference = max((last["state"][k] - v).abs().max().item() for k, v in alone["state"].items())
        print(
            f"final | train_loss {last['train_loss']:.4f} | test_loss {last['test_loss']:.4f}"
            f" | one process: test_loss {alone['test_loss']:.4f} | largest weight difference {difference:.1e}"
            f" | median step time {last['step_ms']:.2f}ms"
        )

# ruff: noqa: F401, F821, F841, B007 - what a stub leaves unused or undefined until it is written
