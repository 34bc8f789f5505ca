# Your copy of the exercise code: fill in every TODO, then `make grade` checks it.
"""Exercise 13: fully sharded data parallelism by hand: gradients sharded (ZeRO-2), then parameters too (ZeRO-3).

    python fsdp.py --world-size 2          # DDP, ZeRO-1, ZeRO-2, ZeRO-3: bytes per rank, step time, loss
    python fsdp.py --world-size 2 --amp    # the same in bfloat16: ZeRO-2 and -3 gather bfloat16 copies

Exercise 11 sharded the optimizer state; every rank still held the whole model and its whole
gradient. Here each layer keeps its parameters as one flat float32 shard per rank, 1/W of them.
ZeRO-2 gathers the whole parameters and keeps them, and leaves each rank only its shard of the
averaged gradient (a reduce-scatter); ZeRO-3, PyTorch's FSDP, also frees a layer's gathered
parameters as soon as its forward is done and gathers them again for its backward.

Handout: exercises/13_fsdp.md.
"""

import math
import statistics
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from course.device import amp_dtype, current_device, synchronize
from course.launch import launch, launch_options
from course.memory import Gathered
from mlp import MLP, ModelConfig, batches, config_from, evaluate, gen_dataset, make_parser, split_dataset, wrap_ddp
from zero import ShardedOptimizer, state_bytes

if TYPE_CHECKING:  # imported where used: DTensor's import takes seconds, and every exercise's checks load this file
    from torch.distributed.tensor import DTensor

# Part A: flat shards and the two collectives.


def flat_shard(tensors: list[torch.Tensor], rank: int, world_size: int) -> torch.Tensor:
    """Piece `rank` of world_size equal pieces of the tensors, flattened into one and padded with zeros at its end.

    A tensor of its own (not a view), so that nothing keeps the whole flat tensor alive.
    """
    # TODO(exercise 13): concatenate, pad to a multiple of world_size, keep piece `rank`.
    raise NotImplementedError("Exercise 13: flat_shard is not written yet, see exercises/13_fsdp.md")


def views(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Views of flat's first elements as tensors of the given shapes, in order; the padding after them is left out."""
    # TODO(exercise 13): views, not copies: what the views compute with is flat's memory.
    raise NotImplementedError("Exercise 13: views is not written yet, see exercises/13_fsdp.md")


def free(full: torch.Tensor) -> None:
    """Release full's memory: its storage shrinks to 0 bytes. Views of full, autograd's saved ones too, then hold nothing."""
    # TODO(exercise 13): one line. Dropping a name is not enough while autograd keeps views of full.
    raise NotImplementedError("Exercise 13: free is not written yet, see exercises/13_fsdp.md")


def gather_into(full: torch.Tensor, shard: torch.Tensor) -> None:
    """Fill full with every rank's shard, in rank order, cast to full's dtype: one dist.all_gather_into_tensor.

    full's storage may have been freed: make it full-sized again first. Write through full.data:
    autograd saved views of full in the forward and refuses to use them if it sees full change.
    """
    # TODO(exercise 13): the storage back to full size, then the all-gather into it.
    raise NotImplementedError("Exercise 13: gather_into is not written yet, see exercises/13_fsdp.md")


def reduce_scatter_mean(full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of the average over the ranks of full, in float32: one dist.reduce_scatter_tensor, then 1/W."""
    # TODO(exercise 13): a new float32 tensor of 1/W of full's elements.
    raise NotImplementedError("Exercise 13: reduce_scatter_mean is not written yet, see exercises/13_fsdp.md")


# Part B: a unit, one layer whose parameters live as a flat shard.


def set_tensors(module: nn.Module, names: list[str], tensors: list[torch.Tensor]) -> None:
    """module.<name> = tensor for each dotted name, as a plain attribute (a parameter there is removed first)."""
    for name, tensor in zip(names, tensors):
        owner, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner)
        owner._parameters.pop(leaf, None)
        setattr(owner, leaf, tensor)


def cast_floats(inputs: tuple, dtype: torch.dtype) -> list:
    """The inputs, floating-point tensors among them cast to dtype."""
    return [x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]


class FullyShardedUnit(nn.Module):
    """One module whose trainable parameters live as one flat float32 shard on each rank, 1/W of them.

    Just before the module's forward the unit gathers its full parameters into self.full and gives
    the module views of them. ZeRO-3 (reshard_after_forward=True) frees them after the forward and
    gathers them again just before the module's backward; ZeRO-2 keeps them. When the backward has
    made the gradient of self.full, post_backward leaves the shard's .grad the average over the ranks
    of this rank's piece of it, and frees the rest. With param_dtype=torch.bfloat16 the module
    computes in bfloat16 from gathered bfloat16 copies; the shard and its gradient stay float32.

    Frozen parameters (requires_grad=False) stay in the module, whole on every rank. So
    model.parameters() yields the shards and the frozen parameters: an optimizer over them steps
    1/W of the model on each rank.
    """

    def __init__(
        self, module: nn.Module, reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.module, self.reshard_after_forward = module, reshard_after_forward
        # TODO(exercise 13): self.names and self.shapes of the module's parameters that train; self.shard, this
        # rank's float32 flat shard of them, an nn.Parameter; self.full, an empty tensor of param_dtype (else
        # float32) for the W shards, freed, that requires grad and calls post_backward once its gradient is
        # complete (register_post_accumulate_grad_hook).
        raise NotImplementedError("Exercise 13: FullyShardedUnit.__init__ is not written yet, see exercises/13_fsdp.md")
        set_tensors(module, self.names, [None] * len(self.names))  # the module's own parameters go: forward sets views

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The module's forward on the gathered parameters, floating-point inputs cast to their dtype."""
        # TODO(exercise 13): gather, give the module views of self.full (set_tensors), run it; ZeRO-3: free
        # self.full and have pre_backward called with the gradient of the output (register_hook).
        raise NotImplementedError("Exercise 13: FullyShardedUnit.forward is not written yet, see exercises/13_fsdp.md")

    def pre_backward(self, grad: torch.Tensor) -> None:
        """Called with the gradient of the unit's output, before the module's backward: gather the parameters again."""
        # TODO(exercise 13): one line.
        raise NotImplementedError(
            "Exercise 13: FullyShardedUnit.pre_backward is not written yet, see exercises/13_fsdp.md"
        )

    def post_backward(self, full: torch.Tensor) -> None:
        """Called once full.grad is complete: add the average's shard to self.shard.grad, free full.grad (and full)."""
        # TODO(exercise 13): reduce-scatter full.grad; self.shard.grad accumulates like a parameter's .grad.
        raise NotImplementedError(
            "Exercise 13: FullyShardedUnit.post_backward is not written yet, see exercises/13_fsdp.md"
        )


def shard_layers(
    container: nn.Module, reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None
) -> None:
    """Replace each child of container (an nn.Sequential or nn.ModuleList) that has parameters to train by a
    FullyShardedUnit of it; pass the others through.

    Every rank must call it on the same model, in the same state: the units shard what each rank holds.
    """
    # TODO(exercise 13): one unit per child with a trainable parameter, at the child's place.
    raise NotImplementedError("Exercise 13: shard_layers is not written yet, see exercises/13_fsdp.md")


def units(model: nn.Module) -> list[tuple[str, FullyShardedUnit]]:
    """The model's units, by their names in it, in order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FullyShardedUnit)]


# Part C: a sharded checkpoint that any number of ranks can read.


def flat_piece(shard: torch.Tensor, numel: int, mesh: DeviceMesh) -> "DTensor":
    """This rank's shard as its piece of a flat tensor of numel elements, the padding left out.

    A DTensor sharded on dim 0 over the mesh's ranks, as torch.chunk cuts it: rank r's piece starts
    at r * shard.numel(), the last pieces are shorter or empty. It uses the shard's memory, so that
    loading a checkpoint into it fills the shard.
    """
    from torch.distributed.tensor import DTensor, Shard

    # TODO(exercise 13): DTensor.from_local with the global shape: a checkpoint must not depend on W.
    raise NotImplementedError("Exercise 13: flat_piece is not written yet, see exercises/13_fsdp.md")


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Adam) -> dict:
    """What a checkpoint holds, by key, for each unit (its name in the model, say "layers.0"): the unit's flat
    parameter (key: the name), Adam's two moments of it ("<name>.exp_avg", "<name>.exp_avg_sq"), each as a
    flat_piece, and Adam's step count ("<name>.step", a plain tensor, the same on every rank).

    An Adam that has not stepped yet has no state: give it zeros (and a step count of 0.0) to load into.
    """
    mesh = init_device_mesh(current_device().type, (dist.get_world_size(),))
    state = {}
    for name, unit in units(model):
        numel = sum(math.prod(shape) for shape in unit.shapes)
        # TODO(exercise 13): optimizer.state[unit.shard] is Adam's state of the shard: a dict, empty before a step.
        raise NotImplementedError("Exercise 13: checkpoint_state is not written yet, see exercises/13_fsdp.md")
    return state


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Adam, folder: str) -> None:
    """Every rank writes its pieces into folder (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(checkpoint_state(model, optimizer), checkpoint_id=folder)


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Adam, folder: str) -> None:
    """Every rank reads its pieces from folder, whatever the world size that saved it."""
    import torch.distributed.checkpoint as dcp

    dcp.load(checkpoint_state(model, optimizer), checkpoint_id=folder)


# Part D: training, and what each strategy holds per rank.

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def setup(model: nn.Module, strategy: str, lr: float, param_dtype: torch.dtype | None = None) -> tuple:
    """(the module to call, its Adam) for 'ddp' (built-in), 'zero1' (exercise 11), 'zero2' or 'zero3' (whose units
    gather param_dtype copies when it is given)."""
    if strategy == "ddp":
        return wrap_ddp(model), torch.optim.Adam(model.parameters(), lr=lr)
    if strategy == "zero1":
        return model, ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=lr)
    # TODO(exercise 13): ZeRO-2 or ZeRO-3: shard the layers of model.layers, then an Adam over what the model holds.
    raise NotImplementedError("Exercise 13: setup is not written yet, see exercises/13_fsdp.md")


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under the tensors: a view counts for all the memory it keeps."""
    storages = {}
    for t in tensors:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def train(config: ModelConfig, strategy: str) -> dict:
    """Train the MLP with Adam under one strategy; rank 0 returns the figures and every rank's bytes.

    Every rank starts from the same weights and builds the same data; batch i belongs to rank
    i % world_size. With config.amp, ZeRO-2 and -3 gather bfloat16 copies, DDP and ZeRO-1 autocast.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = current_device()
    torch.manual_seed(config.seed)
    train_set, test_set = split_dataset(*(t.to(device) for t in gen_dataset(config, rand_state=config.seed)))
    model = MLP(config).to(device)
    precision = amp_dtype(device) if config.amp else None
    sharded = strategy in ("zero2", "zero3")
    forward, optimizer = setup(model, strategy, config.lr, precision if sharded else None)
    step, step_times = 0, []
    with Gathered() as gathered:
        for i, x, y in batches(*train_set, config.batch_size, config.seed):
            if step == config.niters:
                break
            if i % world_size != rank:
                continue
            synchronize(device)
            t0 = time.perf_counter()
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=precision, enabled=config.amp and not sharded):
                _, loss = forward(x, y)
            loss.backward()
            grad_bytes = storage_bytes(p.grad for p in model.parameters() if p.grad is not None)
            optimizer.step()
            synchronize(device)
            step_times.append((time.perf_counter() - t0) * 1000)
            step += 1
        test_loss = evaluate(model, test_set)  # on every rank: the units' forward gathers
    mine = [storage_bytes(model.parameters()), gathered.peak_bytes(), grad_bytes, state_bytes(optimizer)]
    everyone = [torch.zeros(4, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(everyone, torch.tensor(mine, device=device))
    return {
        "strategy": strategy,
        "train_loss": loss.item(),
        "test_loss": test_loss,
        "step_ms": statistics.median(step_times),
        "bytes": [dict(zip(("parameters", "gathered", "gradients", "optimizer"), map(int, b))) for b in everyone],
    }


def compare(config: ModelConfig, strategies: tuple = STRATEGIES) -> list:
    """train() under each strategy in turn, in one world."""
    return [train(config, strategy) for strategy in strategies]


def print_table(results: list) -> None:
    print(
        f"{'strategy':8} {'rank':>4} {'parameters':>10} {'gathered':>10} {'gradients':>10} {'optimizer':>10}"
        f" {'total':>10} {'step ms':>8} {'loss':>7}"
    )
    for result in results:
        for rank, held in enumerate(result["bytes"]):
            print(
                f"{result['strategy']:8} {rank:>4} "
                + " ".join(f"{b:>10}" for b in held.values())
                + f" {sum(held.values()):>10} {result['step_ms']:>8.2f} {result['test_loss']:>7.4f}"
            )


if __name__ == "__main__":
    parser = make_parser(__doc__)
    parser.set_defaults(learning_rate=0.001, niters=100)
    args = parser.parse_args()
    print_table(launch(compare, args.world_size, config_from(args), **launch_options(args))[0])
    print(
        "bytes: parameters = model.parameters(), gathered = peak of the gathered full parameters, gradients"
        " = their .grad after backward, optimizer = Adam's state; loss = test loss after training"
    )
    if args.check_collectives:  # built-in DDP's collectives go through a group of their own, unchecked
        print("step ms: every collective but DDP's is checked; time them with --no-check-collectives")

# ruff: noqa: F401, F821, F841, B007 - what a stub leaves unused or undefined until it is written
