"""The checks of exercise 13 catch the mistakes of flat shards, ZeRO-2, ZeRO-3 and a sharded checkpoint.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
mistake and shows that the check for it fails, with a message that points at the mistake.

Left out on purpose: gather_into without making the storage full-sized again. The all-gather then
writes through a pointer to freed memory, which crashes the worker or corrupts it silently; the
checks see a crash, but no message can name it reliably.
"""

import pytest

from checks.test_ex13_fsdp import (
    check_against_fully_shard,
    check_any_module,
    check_checkpoint,
    check_flat_piece,
    check_flat_shard,
    check_frozen,
    check_gather,
    check_gradient_shards,
    check_memory,
    check_mixed_precision,
    check_reduce_scatter,
    check_setup,
    check_sharded_bytes,
    check_steps,
    check_views,
    check_zero2_keeps,
)
from course.launch import WorldFailed
from tests.mutants import assert_caught, assert_torch_own_caught, make_mutant, plant

PAD = "    padded = F.pad(flat, (0, -flat.numel() % world_size))\n"
PIECE = "    return padded.chunk(world_size)[rank].clone()\n"
REDUCE = "    dist.reduce_scatter_tensor(shard, full.float())\n    return shard.div_(world_size)\n"
NEW_SHARD = "    shard = full.new_empty(full.numel() // world_size, dtype=torch.float32)\n"
FORWARD_FREE = "            free(self.full)\n            if output.requires_grad:"
AFTER_BACKWARD = "        full.grad = None\n        if self.reshard_after_forward:\n            free(full)\n"
GATHER = "    dist.all_gather_into_tensor(full.data, shard.detach().to(full.dtype))\n"
VIEWS = "    return [piece.view(shape) for piece, shape in zip(flat[: sum(sizes)].split(sizes), shapes)]\n"
VALID = "    valid = shard.detach()[: max(0, min(shard.numel(), numel - start))]\n"

MUTANTS = {
    "ZeRO-3 frees the gathered parameters only where a backward will come": (
        "        if self.reshard_after_forward:\n            free(self.full)\n            if output.requires_grad:\n"
        "                output.register_hook(self.pre_backward)\n",
        "        if self.reshard_after_forward and output.requires_grad:\n            free(self.full)\n"
        "            output.register_hook(self.pre_backward)\n",
        lambda folder: check_steps(folder, 2, zero3=True, steps=1),
        "after the model's forward in evaluation (model.eval(), torch.no_grad()), the units' gathered parameters"
        " still hold",
    ),
    "ZeRO-3 frees the gathered parameters only in training mode": (
        "        if self.reshard_after_forward:\n            free(self.full)\n            if output.requires_grad:\n",
        "        if self.reshard_after_forward and self.training:\n            free(self.full)\n"
        "            if output.requires_grad:\n",
        lambda folder: check_steps(folder, 2, zero3=True, steps=1),
        "ZeRO-3 frees them after every forward, in training or not",
    ),
    # Part A: flat shards and the collectives
    "a shard interleaved (every W-th element)": (
        PIECE,
        "    return padded[rank::world_size].clone()\n",
        check_flat_shard,
        "one contiguous piece",
    ),
    "the pieces in reverse rank order": (
        PIECE,
        "    return padded.chunk(world_size)[world_size - 1 - rank].clone()\n",
        check_flat_shard,
        "so that an all-gather, which puts the pieces in rank order",
    ),
    "the padding at the front": (
        "    padded = F.pad(flat, (0, -flat.numel() % world_size))\n",
        "    padded = F.pad(flat, (-flat.numel() % world_size, 0))\n",
        check_flat_shard,
        "the padding goes at the end",
    ),
    "the padding at the front, seen in training": (
        "    padded = F.pad(flat, (0, -flat.numel() % world_size))\n",
        "    padded = F.pad(flat, (-flat.numel() % world_size, 0))\n",
        lambda folder: check_steps(folder, 2, zero3=True, steps=1),
        "the padding goes at the end, after the last parameter",
    ),
    "a shard that is a view of the whole padded tensor": (
        PIECE,
        "    return padded.chunk(world_size)[rank]\n",
        check_flat_shard,
        "keeps all of it alive, where the docstring asks for a tensor of its own",
    ),
    # The padding taken to be in front: the views cut from flat's last elements, the padding in the last one.
    "views that take the padding": (
        VIEWS,
        VIEWS.replace("flat[: sum(sizes)]", "flat[flat.numel() - sum(sizes) :]"),
        check_views,
        "the padding is after the last tensor",
    ),
    "views that take the padding, seen in training": (
        VIEWS,
        VIEWS.replace("flat[: sum(sizes)]", "flat[flat.numel() - sum(sizes) :]"),
        lambda folder: check_steps(folder, 2, zero3=True, steps=1),
        "its views take the gathered tensor's first elements",
    ),
    "views that are copies": (
        "    return [piece.view(shape) for piece, shape",
        "    return [piece.clone().view(shape) for piece, shape",
        check_views,
        "is a copy",
    ),
    "free drops a name, not the memory": (
        "    full.untyped_storage().resize_(0)\n",
        "    del full\n",
        check_gather,
        "the memory under full stays",
    ),
    "free replaces full with an empty tensor": (
        "    full.untyped_storage().resize_(0)\n",
        "    full.data = torch.empty(0)\n",
        check_gather,
        "full has shape [0]: free gave full other data, a new tensor",
    ),
    "the shard handed to the all-gather as the Parameter itself (Hint 3 read literally)": (
        GATHER,
        "    dist.all_gather_into_tensor(full.data, shard.to(full.dtype))\n",
        check_gather,
        "the all-gather got a tensor that requires grad",
    ),
    # What torch does now and then with the mistake above (gloo raises in its thread, after the exchange, on
    # some ranks only): the ranks must not part, the one that did not raise waiting in the next all-gather.
    "torch's error for the Parameter handed to the all-gather, raised on some ranks only": (
        GATHER,
        GATHER + "    if dist.get_rank() != 2:\n"
        "        raise RuntimeError('A view was created in no_grad mode and is being modified inplace')\n",
        check_gather,
        "the all-gather got a tensor that requires grad",
    ),
    "the parameters freed before the module's forward": (
        "        output = self.module(*cast_floats(inputs, self.full.dtype))\n        if self.reshard_after_forward:\n"
        "            free(self.full)\n",
        "        if self.reshard_after_forward:\n            free(self.full)\n"
        "        output = self.module(*cast_floats(inputs, self.full.dtype))\n        if self.reshard_after_forward:\n",
        lambda folder: check_steps(folder, 2, zero3=True, steps=1),
        "unit 0's module was called with freed parameters",
    ),
    "the re-gather hook registered under torch.no_grad() too": (
        "            if output.requires_grad:\n                output.register_hook(self.pre_backward)\n",
        "            output.register_hook(self.pre_backward)\n",
        lambda folder: check_steps(folder, 2, zero3=True, steps=1),
        "the model's forward under torch.no_grad() (as in evaluation) raised",
    ),
    "an extra padding piece in flat_shard, seen by the frozen parameter's check": (
        PAD,
        PAD.replace("-flat.numel() % world_size", "world_size - flat.numel() % world_size"),
        check_frozen,
        "flat_shard cuts units of [84, 77, 55] trainable parameters into pieces of [43, 39, 28] elements",
    ),
    "an extra padding piece in flat_shard, seen by setup's check": (
        PAD,
        PAD.replace("-flat.numel() % world_size", "world_size - flat.numel() % world_size"),
        check_setup,
        "flat_shard cuts units of",
    ),
    "Adam's two moments given one zeros tensor": (
        "exp_avg=zeros, exp_avg_sq=zeros.clone()",
        "exp_avg=zeros, exp_avg_sq=zeros",
        check_checkpoint,
        "exp_avg and exp_avg_sq of unit 0 (Linear(12, 7), 91 parameters) are one tensor",
    ),
    "shards gathered in reverse rank order": (
        GATHER,
        "    dist.all_gather(list(full.data.chunk(dist.get_world_size()))[::-1], shard.detach().to(full.dtype))\n",
        check_gather,
        "in the order [2, 1, 0]: rank order",
    ),
    "a reduce-scatter without the 1/W": (
        REDUCE,
        "    dist.reduce_scatter_tensor(shard, full.float())\n    return shard\n",
        check_reduce_scatter,
        "3.0x the expected average: did you divide by the world size?",
    ),
    "a reduce-scatter without the 1/W, seen in the gradients": (
        REDUCE,
        "    dist.reduce_scatter_tensor(shard, full.float())\n    return shard\n",
        check_gradient_shards,
        "2.0x the expected average: did you divide by the world size?",
    ),
    "an all-reduce where a reduce-scatter belongs": (
        REDUCE,
        "    whole = full.float()\n    dist.all_reduce(whole)\n"
        "    return whole.chunk(world_size)[dist.get_rank()] / world_size\n",
        check_gradient_shards,
        "an all-reduce gives every rank the whole averaged gradient",
    ),
    "an all-reduce, and the shard a view of its whole result": (
        REDUCE,
        "    whole = full.float()\n    dist.all_reduce(whole)\n"
        "    return whole.chunk(world_size)[dist.get_rank()].div_(world_size)\n",
        check_sharded_bytes,
        "a piece cut from a full gradient",
    ),
    "gradients reduced in bfloat16": (
        NEW_SHARD + REDUCE,
        "    shard = full.new_empty(full.numel() // world_size)\n    dist.reduce_scatter_tensor(shard, full)\n"
        "    return shard.float().div_(world_size)\n",
        check_reduce_scatter,
        "reduce in float32",
    ),
    "flat_shard's flat tensor float32 whatever the tensors' dtype": (
        "    flat = torch.cat([t.detach().reshape(-1) for t in tensors])\n",
        "    flat = torch.zeros(sum(t.numel() for t in tensors))\n"
        "    flat[:] = torch.cat([t.detach().reshape(-1) for t in tensors])\n",
        check_flat_shard,
        "flat_shard of float64 tensors of shapes [(3, 4), (5,)] (17 elements), rank 0 of 2 is float32: the shard"
        " holds the tensors' elements, in their dtype",
    ),
    "reduce_scatter_mean casts bfloat16 up, not everything to float32": (
        NEW_SHARD + "    dist.reduce_scatter_tensor(shard, full.float())\n",
        "    full = full.float() if full.dtype == torch.bfloat16 else full\n"
        "    shard = full.new_empty(full.numel() // world_size)\n"
        "    dist.reduce_scatter_tensor(shard, full)\n",
        check_reduce_scatter,
        "reduce_scatter_mean of a float64 tensor returned torch.float64",
    ),
    # Part B: the unit
    "frozen parameters sharded with the others": (
        "        self.names = [name for name, p in module.named_parameters() if p.requires_grad]\n",
        "        self.names = [name for name, p in module.named_parameters()]\n",
        check_frozen,
        "out of the shard",
    ),
    "every child wrapped, Tanh too": (
        "        if any(p.requires_grad for p in child.parameters()):\n"
        "            setattr(container, name, FullyShardedUnit(child, reshard_after_forward, param_dtype))\n",
        "        setattr(container, name, FullyShardedUnit(child, reshard_after_forward, param_dtype))\n",
        lambda folder: check_steps(folder, 2, zero3=False, steps=1),
        "a module without parameters is passed through",
    ),
    "a wholly frozen layer wrapped": (
        "        if any(p.requires_grad for p in child.parameters()):\n",
        "        if any(True for p in child.parameters()):\n",
        check_any_module,
        "a child with no parameter to train (the frozen Linear) is passed through",
    ),
    "every input cast, integers too": (
        "        output = self.module(*cast_floats(inputs, self.full.dtype))\n",
        "        output = self.module(*(x.to(self.full.dtype) for x in inputs))\n",
        check_any_module,
        "only the floating-point inputs are cast",
    ),
    "the shard in the module's dtype": (
        "        self.shard = nn.Parameter(flat_shard(params, dist.get_rank(), world_size).float())\n",
        "        self.shard = nn.Parameter(flat_shard(params, dist.get_rank(), world_size))\n",
        check_any_module,
        "a unit's shard is float32 whatever its module's dtype",
    ),
    "the full gradient zeroed, not freed": (
        AFTER_BACKWARD,
        AFTER_BACKWARD.replace("full.grad = None", "full.grad.zero_()"),
        check_any_module,
        "post_backward frees the full gradient once its piece is taken",
    ),
    "the gathered parameters in float32 whatever param_dtype says": (
        "dtype=param_dtype or torch.float32)",
        "dtype=torch.float32)",
        check_mixed_precision,
        "computes from gathered bfloat16 copies",
    ),
    "ZeRO-2 gathers once, and computes with old parameters after": (
        "        gather_into(self.full, self.shard)\n        set_tensors(",
        "        if self.full.untyped_storage().nbytes() == 0:\n            gather_into(self.full, self.shard)\n"
        "        set_tensors(",
        lambda folder: check_steps(folder, 2, zero3=False, steps=2),
        "gather the updated shards before every forward",
    ),
    "ZeRO-2 frees and gathers again like ZeRO-3": (
        "        if self.reshard_after_forward:\n            free(self.full)",
        "        if True:\n            free(self.full)",
        lambda folder: check_steps(folder, 2, zero3=False, steps=1),
        "ZeRO-2 keeps the gathered parameters for the backward",
    ),
    "ZeRO-2 frees after the backward": (
        "        if self.reshard_after_forward:\n            free(full)\n",
        "        free(full)\n",
        check_zero2_keeps,
        "ZeRO-2 keeps them",
    ),
    "the full buffer not freed when the unit is made": (
        "        free(self.full)\n        self.full.requires_grad_()",
        "        self.full.requires_grad_()",
        check_memory,
        "a unit is made with its full buffer freed",
    ),
    "ZeRO-3 does not free after the forward": (
        FORWARD_FREE,
        "            if output.requires_grad:",
        check_memory,
        "free them after the unit's forward",
    ),
    "ZeRO-3 does not free after the backward": (
        AFTER_BACKWARD,
        "        full.grad = None\n",
        check_memory,
        "free them after the unit's backward too",
    ),
    "every unit gathered up front": (
        "            setattr(container, name, FullyShardedUnit(child, reshard_after_forward, param_dtype))\n",
        "            setattr(container, name, FullyShardedUnit(child, reshard_after_forward, param_dtype))\n"
        "    gather = [m for m in container.children() if isinstance(m, FullyShardedUnit)]\n"
        "    container.register_forward_pre_hook(lambda *_: [gather_into(m.full, m.shard) for m in gather] and None)\n",
        check_memory,
        "not all of them up front",
    ),
    "no gather again before the backward": (
        "        # TODO(exercise 13): one line.\n        ### BEGIN SOLUTION\n        gather_into(self.full, self.shard)\n",
        "        # TODO(exercise 13): one line.\n        ### BEGIN SOLUTION\n        pass\n",
        lambda folder: check_steps(folder, 2, zero3=True, steps=1),
        "gather them again before the unit's backward",
    ),
    "the all-gather written where autograd sees it": (
        GATHER,
        "    dist.all_gather_into_tensor(full, shard.detach().to(full.dtype))\n",
        lambda folder: check_steps(folder, 2, zero3=True, steps=1),
        "write through full.data",
    ),
    "the full gradient kept from step to step": (
        AFTER_BACKWARD,
        "        if self.reshard_after_forward:\n            free(full)\n",
        check_gradient_shards,
        "full gradient was still in full.grad when this step's backward added to it",
    ),
    "the shard's gradient replaced, not accumulated": (
        "        self.shard.grad = grad if self.shard.grad is None else self.shard.grad + grad\n",
        "        self.shard.grad = grad\n",
        check_gradient_shards,
        "add to shard.grad when it is there already",
    ),
    "the gradient not averaged over the ranks": (
        "        grad = reduce_scatter_mean(full.grad)\n",
        "        grad = full.grad.float().chunk(dist.get_world_size())[dist.get_rank()].clone()\n",
        check_gradient_shards,
        "is not the average of the ranks' gradients",
    ),
    # Part C and D: the checkpoint, and the training loop's setup
    "the padding kept in the checkpoint, its global size padded too": (
        VALID + "    return DTensor.from_local(valid, mesh, [Shard(0)], run_check=False, shape=torch.Size([numel])",
        "    valid = shard.detach()\n    return DTensor.from_local(valid, mesh, [Shard(0)], run_check=False,"
        " shape=torch.Size([shard.numel() * mesh.size()])",
        check_flat_piece,
        "is the 10 real elements, whatever the world size",
    ),
    "the padding kept in the checkpoint's pieces": (
        VALID,
        "    valid = shard.detach()\n",
        check_flat_piece,
        "leave the padding out",
    ),
    "the checkpoint's pieces copies of the shards": (
        VALID,
        "    valid = shard.detach()[: max(0, min(shard.numel(), numel - start))].clone()\n",
        check_flat_piece,
        "loading a checkpoint into it would leave the shard as it was",
    ),
    "the checkpoint's pieces cut from the end of the shards": (
        VALID,
        "    valid = shard.detach()[shard.numel() - max(0, min(shard.numel(), numel - start)) :]\n",
        check_flat_piece,
        "rank 3's piece is its shard's elements that come before the global size",
    ),
    "Adam's step count left out of the checkpoint": (
        '        state[f"{name}.step"] = adam["step"]\n',
        "",
        check_checkpoint,
        "and a resumed run must go on counting",
    ),
    "flat_piece's piece past the end not empty": (
        VALID,
        "    valid = shard.detach()[: min(shard.numel(), numel - start)]\n",
        check_flat_piece,
        "is at or past the end of the 5 real elements, so its piece is empty",
    ),
    "flat_piece placed by the world's rank, not the mesh's": (
        "    start = mesh.get_local_rank() * shard.numel()\n",
        "    start = dist.get_rank() * shard.numel()\n",
        check_flat_piece,
        "a piece's place is this rank's place in the mesh it is given",
    ),
    "a fresh Adam given no state to load into": (
        "        if not adam:\n",
        "        if False:\n",
        check_checkpoint,
        "an Adam that has not stepped has no state yet",
    ),
    "setup's zero2 sharded as ZeRO-3": (
        'reshard_after_forward=strategy == "zero3", param_dtype=param_dtype)',
        "reshard_after_forward=True, param_dtype=param_dtype)",
        check_setup,
        "ZeRO-2 keeps each layer's gathered parameters for its backward",
    ),
    "setup's param_dtype not passed on": (
        'reshard_after_forward=strategy == "zero3", param_dtype=param_dtype)',
        'reshard_after_forward=strategy == "zero3")',
        check_setup,
        "the units gather bfloat16 copies when setup is given param_dtype",
    ),
    "the optimizer built before sharding": (
        '    shard_layers(model.layers, reshard_after_forward=strategy == "zero3", param_dtype=param_dtype)\n'
        "    return model, torch.optim.Adam(model.parameters(), lr=lr)\n",
        "    optimizer = torch.optim.Adam(model.parameters(), lr=lr)\n"
        '    shard_layers(model.layers, reshard_after_forward=strategy == "zero3", param_dtype=param_dtype)\n'
        "    return model, optimizer\n",
        check_setup,
        "build the optimizer after shard_layers",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, "fsdp.py", *MUTANTS[mistake])


def test_reduce_scatter_is_judged_apart_from_free(tmp_path):
    """reduce_scatter_mean's check runs nothing else of fsdp.py: a free not written yet costs only the checks
    that use it."""
    folder = make_mutant(
        tmp_path / "mutant",
        "fsdp.py",
        "    full.untyped_storage().resize_(0)\n",
        '    raise NotImplementedError("Exercise 13: free is not written yet, see exercises/13_fsdp.md")\n',
    )
    with pytest.raises(WorldFailed, match="free is not written yet"):
        check_gather(folder)
    check_reduce_scatter(folder)


def test_checkpoint_is_judged_apart_from_flat_piece(tmp_path):
    """A wrong flat_piece costs its own check, not the checkpoint's, which calls it."""
    folder = make_mutant(tmp_path / "mutant", "fsdp.py", VALID, "    valid = shard.detach()\n")
    with pytest.raises(AssertionError, match="leave the padding out"):
        check_flat_piece(folder)
    check_checkpoint(folder)


# Issue 47: the all-gather as torch's DTensor makes it (fully_shard's parameters are DTensors): right values, and the
# kernel's count of DTensor's C++ constructor and dispatch tells.
TORCH_OWN = (
    "fsdp.py",
    "    dist.all_gather_into_tensor(full.data, shard.detach().to(full.dtype))\n",
    "    from torch.distributed.tensor import DTensor, Shard\n"
    "\n"
    '    mesh = init_device_mesh("cpu", (dist.get_world_size(),))\n'
    "    piece = DTensor.from_local(shard.detach().to(full.dtype), mesh, [Shard(0)], run_check=False)\n"
    "    full.data.copy_(piece.full_tensor())\n",
    lambda folder: check_against_fully_shard(folder, False),
    "DTensor",
)


def test_torch_own_dtensor_is_caught(tmp_path, monkeypatch):
    assert_torch_own_caught(tmp_path / "mutant", "the all-gather as a DTensor's", *TORCH_OWN, monkeypatch)


def test_the_collectives_written_with_torchs_functional_collectives_pass(tmp_path):
    """Issue 47: a correct program written any way torch allows gets full marks. The all-gather and the
    reduce-scatter as torch's functional collectives (torch.distributed._functional_collectives, which reach the
    process group from C++): the communication log sees them as the process group's own, bytes and all."""
    folder = make_mutant(
        tmp_path / "functional",
        "fsdp.py",
        "    dist.all_gather_into_tensor(full.data, shard.detach().to(full.dtype))\n",
        '    functional = __import__("torch.distributed._functional_collectives", fromlist=["all_gather_tensor"])\n'
        "    full.data.copy_(functional.all_gather_tensor(shard.detach().to(full.dtype), 0, dist.group.WORLD))\n",
    )
    plant(
        folder,
        "fsdp.py",
        "    shard = full.new_empty(full.numel() // world_size, dtype=torch.float32)\n"
        "    dist.reduce_scatter_tensor(shard, full.float())\n",
        '    functional = __import__("torch.distributed._functional_collectives", fromlist=["reduce_scatter_tensor"])\n'
        '    shard = functional.reduce_scatter_tensor(full.float(), "sum", 0, dist.group.WORLD).clone()\n',
    )
    check_gather(folder)
    check_reduce_scatter(folder)
    check_steps(folder, 2, True, steps=1)
