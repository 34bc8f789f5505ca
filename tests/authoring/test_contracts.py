"""Every promise a student reads is checked: each sentence of a student function's docstring or TODO
that makes a promise of a kind the checks keep missing (a marked phrase: "every", "in place",
"dtype", "group", "float", "at most", "bool") names what checks it, in PROMISES: a contract of
checks/contracts.py, by its function and the kind of promise, or a named check, "test_exN_x.test_y".
A sentence that binds the caller, not the function ("every rank must call it on the same model"),
sits in CALLER with how the checks keep it.

A sentence changed in solutions/ is a sentence to map again: the test fails on it, and on a mapping
that no sentence uses any more.
"""

import ast
import importlib
import os
import re

import pytest

from checks.contracts import CONTRACTS
from course.exercises import STUDENT_FILES
from course.layout import BEGIN, SOLUTIONS

MARKED = ("every", "in place", "dtype", "group", "float", "at most", "bool")

PROMISES = {
    # exercise 1 and 3: mlp.py
    "mlp.check_parameter_closeness | True on every rank when every rank holds the same parameters (torch.allclose), of any dtype.": "contract mlp.check_parameter_closeness within_tolerance",
    "mlp.check_parameter_closeness | With no process group there is nothing to compare.": "test_ex03_ddp.test_contracts",
    "mlp.train | Train an MLP; in a process group, data-parallel with wrap(model).": "test_ex03_ddp.test_train_shares_batches",
    "mlp.train | Every rank builds the same data.": "test_ex03_ddp.test_train_shares_batches",
    # exercise 2 and 5: dist.py
    "dist.par_matmul_by_row | Broadcast B to every rank, scatter row blocks of A (dist.scatter), multiply locally, and gather the row blocks of C back to rank 0 (dist.gather). m need not divide by the world size.": "test_ex02_dist.test_by_row",
    "dist.par_matmul_by_reduction | Return A @ B on every rank, computed by splitting the reduction dimension k.": "contract dist.par_matmul_by_reduction dtypes",
    "dist.par_matmul_by_reduction | Scatter column blocks of A and row blocks of B, multiply locally into a full m x n partial product, and sum the partial products on every rank with dist.all_reduce.": "test_ex02_dist.test_by_reduction",
    "dist.exchange | Every rank calls it at the same time, each sending to its right and receiving from its left.": "test_ex05_ring.test_ring",
    "dist.exchange | If every rank first sent with the blocking dist.send and only then received, each would wait for a receiver that never comes.": "test_ex05_ring.test_ring",
    "dist.ring_all_reduce | Sum a contiguous tensor over all ranks, in place, with point-to-point messages only.": "test_ex05_ring.test_ring",
    "dist.ring_all_reduce | Reduce-scatter: in W - 1 steps every rank passes one chunk on and adds the chunk that arrives to its own, until each rank holds one chunk summed over all ranks.": "test_ex05_ring.test_ring",
    # exercises 4, 6 and 7: mydp.py
    "mydp.MyDP.__init__ | 1. broadcast rank 0's parameters and buffers (dist.broadcast); 2. register a hook (Tensor.register_hook) on every parameter that requires a gradient; the hook returns the gradient all-reduced (dist.all_reduce) and averaged over ranks.": "contract mydp.MyDP.__init__ syncs",
    "mydp.bucket_parameters | Group parameters into buckets of at most cap_bytes of gradients; returns a list of lists.": "contract mydp.bucket_parameters dtypes",
    "mydp.OverlappedDP._gradient_ready | 1. make sure self.finish_gradient_synchronization runs once this backward pass ends; 2. count the bucket's ready gradients; 3. launch (self._launch), in bucket order, every complete bucket: every rank must start them in the same order.": "test_ex06_overlap.test_bucket_order",
    "mydp.OverlappedDP.finish_gradient_synchronization | Wait for every bucket's all-reduce and copy the averages into .grad; reset for the next pass.": "test_ex06_overlap.test_overlapped_steps",
    "mydp.accumulation_step | Every piece but the last runs inside model.no_sync(); the last backward pass averages the accumulated gradients across ranks.": "test_ex07_accumulation.test_accumulation_step",
    "mydp.accumulation_step | one step, every micro-batch but the last inside model.no_sync().": "test_ex07_accumulation.test_accumulation_step",
    # exercise 8: data.py
    "data.shard_sizes | The rounding rule (largest remainder): every shard first gets the whole part of n * fractions[k]; the samples left over go one each to the shards with the largest fractional parts, the lower rank first among equal ones.": "test_ex08_data.test_shard_sizes",
    "data.shard_sizes | So every size is n * fractions[k] rounded down or up, and shard_sizes(10, [1/3, 1/3, 1/3]) == [4, 3, 3].": "test_ex08_data.test_shard_sizes",
    "data.partition | Every rank calls it with the same arguments and gets the same shards, without communicating: no collective here.": "test_ex08_data.test_partition",
    "data.average_gradients_weighted | Replace every .grad by the gradient of the union batch: the sum over ranks of (m_k / n) g_k.": "test_ex08_data.test_weighted_average",
    "data.average_gradients_weighted | n, the sum of the ranks' counts; then every gradient times m_k / n, summed over the ranks.": "test_ex08_data.test_weighted_average",
    "data.common_steps | Fix (a): the number of steps every rank can take, the smallest of the ranks' `steps`.": "test_ex08_data.test_agreed_steps",
    "data.common_steps | A collective before the training loop (an all-reduce with ReduceOp.MIN, for one); every rank returns the same number.": "test_ex08_data.test_agreed_steps",
    "data.common_steps | the smallest steps over all ranks, the same on every rank.": "test_ex08_data.test_agreed_steps",
    "data.train_joined | Fix (b): train on every whole batch of this rank's shard with built-in DDP under Join.": "test_ex08_data.test_join",
    "data.train_joined | `optimizer` holds `model`'s parameters, which DDP trains in place.": "test_ex08_data.test_join",
    # exercise 9: sync.py
    "sync.global_moments | The backward pass must carry the gradient back through the communication to every rank whose rows made the statistics.": "test_ex09_sync.test_backward",
    "sync.global_moments | count, sum and sum of squares of every rank's rows, summed over the ranks by an all-reduce that autograd can pass gradients through; then the moments.": "test_ex09_sync.test_backward",
    "sync.SyncBatchNorm1d.update_running_stats | update running_mean and running_var in place.": "contract sync.SyncBatchNorm1d.update_running_stats in_place",
    "sync.SyncBatchNorm1d.forward | Training mode: normalise with global_moments(x) and update the running statistics with them, identically on every rank.": "test_ex09_sync.test_forward",
    "sync.average_parameters | Set every parameter of model to its mean over the ranks (dist.all_reduce), in the model's own Parameter objects: the optimizer holds those, and steps whatever values they have.": "test_ex09_sync.test_average_parameters",
    "sync.local_sgd | Train on this rank's batches alone and average the parameters every `period` steps.": "test_ex09_sync.test_local_sgd",
    "sync.local_sgd | The parameters are averaged with average_parameters after steps period, 2 * period, ... and after the last step if it is not one of those, so that every rank ends with the same model. before_average, if given, is called with the number of steps taken just before each averaging.": "test_ex09_sync.test_local_sgd",
    "sync.local_sgd | Returns the loss of every step, as floats.": "test_ex09_sync.test_local_sgd",
    "sync.local_sgd | the loop; period=1 averages after every step.": "test_ex09_sync.test_period_one_is_synchronous",
    # exercise 10: hvd.py
    "hvd.broadcast_parameters | Give every rank rank 0's parameters and buffers (dist.broadcast), in the model's own tensors: an optimizer built before holds the Parameter objects.": "contract hvd.broadcast_parameters in_place",
    "hvd.broadcast_parameters | every parameter and every buffer, from rank 0.": "contract hvd.broadcast_parameters syncs",
    "hvd.broadcast_optimizer_state | Give every rank rank 0's optimizer state: its hyper-parameters, and per parameter what the optimizer keeps (Adam: the step count and both moments), even where a rank holds none yet.": "test_ex10_hvd.test_broadcast_optimizer_state",
    "hvd.broadcast_optimizer_state | rank 0's state_dict, loaded on every rank.": "test_ex10_hvd.test_broadcast_optimizer_state",
    "hvd.DistributedOptimizer.synchronize | Replace every gradient by its mean over the ranks: one all-reduce (dist.all_reduce) per dtype, of a buffer in that dtype, the dtypes in the order their first gradients come.": "test_ex10_hvd.test_mixed_dtypes",
    "hvd.DistributedOptimizer.synchronize | flatten the gradients of each dtype into one tensor, all-reduce it once, and copy the mean back into each gradient.": "test_ex10_hvd.test_mixed_dtypes",
    # exercise 11: zero.py
    "zero.ShardedOptimizer.average_gradients | Replace every parameter's gradient by its mean over the ranks (dist.all_reduce); a frozen one has none.": "contract zero.ShardedOptimizer.step frozen",
    "zero.ShardedOptimizer.average_gradients | every rank needs the average: the owner steps with it.": "test_ex11_zero.test_steps",
    "zero.ShardedOptimizer.share_parameters | Give every rank each parameter's values from the parameter's owner (dist.broadcast).": "test_ex11_zero.test_steps",
    "zero.ShardedOptimizer.share_parameters | every rank calls the same broadcasts in the same order, each from its owner.": "test_ex11_zero.test_steps",
    "zero.bf16_average_hook | DDP's all-reduce of one bucket of gradients, sent in bfloat16: return a future of the average.": "test_ex11_zero.test_hook",
    "zero.bf16_average_hook | Register it with ddp_model.register_comm_hook(ddp_model.process_group, bf16_average_hook):": "test_ex11_zero.test_hook",
    "zero.bf16_average_hook | DDP calls it with that group for every bucket, as soon as the bucket's gradients are ready.": "contract zero.bf16_average_hook group",
    "zero.bf16_average_hook | One all-reduce per bucket, in bfloat16, started without waiting for it (async_op=True): the backward pass goes on while it runs.": "test_ex11_zero.test_hook",
    "zero.bf16_average_hook | bucket.buffer() is the bucket's flat float32 gradients.": "test_ex11_zero.test_hook",
    # exercise 12: cost.py
    "cost.largest_world | the blog's condition, for every R up to `most`.": "test_ex12_cost.test_largest_world",
    # exercises 13 to 15: the checks that exist (helper h3 writes more of them at the same time)
    "fsdp.gather_into | Fill full with every rank's shard, in rank order, cast to full's dtype: one dist.all_gather_into_tensor. full's storage may have been freed: make it full-sized again first.": "test_ex13_fsdp.test_gather",
    "fsdp.reduce_scatter_mean | This rank's piece of the average over the ranks of full, in float32: one dist.reduce_scatter_tensor, then 1/W.": "test_ex13_fsdp.test_reduce_scatter",
    "fsdp.reduce_scatter_mean | a new float32 tensor of 1/W of full's elements.": "test_ex13_fsdp.test_reduce_scatter",
    'fsdp.checkpoint_state | What a checkpoint holds, by key, for each unit (its name in the model, say "layers.0"): the unit\'s flat parameter (key: the name), Adam\'s two moments of it ("<name>.exp_avg", "<name>.exp_avg_sq"), each as a flat_piece, and Adam\'s step count ("<name>.step", a plain tensor, the same on every rank).': "test_ex13_fsdp.test_checkpoint",
    "tp.my_block | W must divide total, so that every rank gets as many: otherwise a ValueError that names `what`, total and W.": "test_ex14_tp.test_uneven",
    "tp.train_step | One optimizer step on the batch (x, y), which every rank holds whole; returns one process's loss on it (the mean cross-entropy over all the rows), on every rank.": "test_ex14_tp.test_train_steps",
    "tp.train_step | Tensor parallel, every rank runs every row and finds the same loss.": "test_ex14_tp.test_train_steps",
    "pp.communicate | Start every send (tensor, to rank) and every receive (into tensor, from rank) at once, then wait for all.": "test_ex15_pp.test_messages",
    "pp.communicate | every send and receive started, then every one waited for.": "test_ex15_pp.test_messages",
    "pp.stage_layers | Every layer is in exactly one stage, in order.": "test_ex15_pp.test_stage_layers",
    "pp.gpipe | Every stage keeps all m micro-batches' activations.": "test_ex15_pp.test_memory",
    "pp.one_f_one_b | Backwards run in micro-batch order, each as early as the stages after allow, so stage s keeps at most p - s micro-batches' activations at once.": "test_ex15_pp.test_memory",
    # exercises 13 to 15, beyond the above (issue 40's checks of them)
    "fsdp.FullyShardedUnit.__init__ | self.names and self.shapes of the module's parameters that train; self.shard, this rank's float32 flat shard of them, an nn.Parameter; self.full, an empty tensor of param_dtype (else float32) for the W shards, freed, that requires grad and calls post_backward once its gradient is complete (register_post_accumulate_grad_hook).": "test_ex13_fsdp.test_any_module",
    "fsdp.FullyShardedUnit.forward | The module's forward on the gathered parameters, floating-point inputs cast to their dtype.": "test_ex13_fsdp.test_any_module",
    "fsdp.setup | (the module to call, its Adam) for 'ddp' (built-in), 'zero1' (exercise 11), 'zero2' or 'zero3' (whose units gather param_dtype copies when it is given).": "test_ex13_fsdp.test_setup",
    "pp.Pipeline.forward | Micro-batch i's forward: its input is x on the first stage, the received activation elsewhere; run the stage; on the last stage compute its loss (micro_batch_loss) and add its value, a float, to self.loss.": "test_ex15_pp.test_gradients",
    # exercise 16: nd.py
    "nd.mesh_groups | The mesh of dp rows and tp columns over the world's dp * tp ranks (else a ValueError naming both and the world size): rank r at row r // tp, column r % tp, as torch's init_device_mesh((dp, tp)) lays them out. dist.new_group is a collective of the whole world: every rank calls it for every group, its own or not, with the same ranks in the same order, and keeps the groups it belongs to.": "test_ex16_nd.test_groups",
    "nd.mesh_groups | (With use_local_synchronization=True a group's members alone call it: torch pairs those calls by their ranks, not their order.)": "test_ex16_nd.test_groups",
    "nd.mesh_groups | one group per row (tp), then one per column (dp); keep this rank's.": "test_ex16_nd.test_groups",
    "nd.Copy.backward | the sum over the group's ranks of grad, in a tensor of its own (no gradient for group).": "test_ex16_nd.test_own_tensors",
    "nd.AllReduce.forward | the sum over the group's ranks of x, in a tensor of its own.": "test_ex16_nd.test_own_tensors",
    "nd.GatherShards.forward | a tensor of the group's size times the shard's elements, all-gathered.": "test_ex16_nd.test_collectives",
    "nd.GatherShards.backward | this rank's piece of the sum over the group's ranks of grad.": "test_ex16_nd.test_collectives",
    "nd.ShardedLinear.forward | Which group does each collective need?": "test_ex16_nd.test_collectives",
    "nd.train_step | One optimizer step on the batch (x, y), which every rank holds whole; returns one process's loss on it (the mean cross-entropy over all its rows), on every rank.": "test_ex16_nd.test_steps",
    "nd.train_step | The rows are split over the dp group: the rank at row i of the mesh runs block i of them, the same rows as the other ranks of its tp group; where dp does not divide the rows, a ValueError naming both.": "test_ex16_nd.test_odd_batch",
    "nd.train_step | The backward must leave every rank's shard the gradient of one process's loss on the whole batch.": "test_ex16_nd.test_steps",
    "nd.train_step | this rank's rows, the loss to backpropagate, and one process's loss, summed in which group?": "test_ex16_nd.test_collectives",
    # exercise 17: ft.py
    "ft.backward | The backward of this rank's rows (x, y) of a batch of batch_size rows, after which every rank's gradients are those of the mean cross-entropy over the whole batch, whatever the world size.": "test_ex17_ft.test_backward",
    "ft.backward | Returns this rank's part of the batch's mean loss (the parts of every rank sum to it).": "test_ex17_ft.test_backward",
    "ft.save | Save the checkpoint of `step` (the steps done so far) in folder, called on every rank.": "test_ex17_ft.test_round_trip",
    "ft.save | It becomes visible in folder only once every rank's shard is written, in one step; a rank that dies at any moment of a save leaves no checkpoint that newest() finds.": "test_ex17_ft.test_killed_in_a_save",
    "ft.load | Load the checkpoint at path, saved on any number of ranks, called on every rank: the model's whole parameters, and this rank's shard [optimizer.lo, optimizer.hi) of them and of Adam's state (its step, exp_avg, exp_avg_sq), taken from the saved shards that overlap it.": "test_ex17_ft.test_reshard",
    "ft.load | every saved shard read; the whole parameters; this rank's piece of each overlapping shard.": "test_ex17_ft.test_reshard",
    # exercise 18: moe.py
    "moe.balance_loss | It is 1 when the load is even and the router as sure of every expert; its gradient reaches the router through P only (f is a count).": "test_ex18_moe.test_balance_loss",
    "moe.within_capacity | Which of this rank's choices `experts` [tokens, k] are kept: a bool tensor of its shape.": "test_ex18_moe.test_within_capacity",
    "moe.within_capacity | Each expert takes at most `limit` of them (every one where limit is None), the first ones in token order (token 0's choices before token 1's, a token's first choice before its second); the others are dropped.": "test_ex18_moe.test_within_capacity",
    "moe.exchange_counts | counts[e]: how many tokens this rank sends to expert e, for every expert of the group (expert e on the group's rank e // per_rank).": "test_ex18_moe.test_exchange_counts",
    "moe.exchange_counts | Returns [group size, per_rank]: row s, how many tokens the group's rank s sends to each expert of this rank, learnt from the group's ranks (an all-to-all does it in one call); no rank guesses them.": "test_ex18_moe.test_exchange_counts",
    "moe.exchange_counts | every rank learns what it will receive, before any token travels.": "test_ex18_moe.test_traffic",
    "moe.dispatch | The counts are exchanged first (exchange_counts), then the rows (AllToAll), both in `group`.": "test_ex18_moe.test_traffic",
    "moe.run_experts | `received` [group size, per_rank] says how the rows came: first rank 0's block, received[0, 0] rows for this rank's first expert, then received[0, 1] for its second, ...; then rank 1's block, and so on.": "test_ex18_moe.test_layer",
    "moe.sync_gradients | After each rank's backward of its own loss: leave every gradient that of the mean over the world's ranks of their losses.": "test_ex18_moe.test_steps",
    "moe.sync_gradients | The parameters on every rank (all but the experts) average their gradients over the world.": "test_ex18_moe.test_steps",
    "moe.sync_gradients | An expert's gradient already sums what every rank of its ep group sent it (AllToAll's backward brought their gradients back to it): it is summed over the ranks that hold the same expert (dp_group), then divided by the world size, not by dp.": "test_ex18_moe.test_steps",
    "moe.sync_gradients | each gradient summed in its group (which one for an expert's?), then divided.": "test_ex18_moe.test_steps",
}

# Sentences that bind the caller, not the function: what its callers must do. Each says how the checks
# keep it, and a sentence may sit here only if it is worded as the caller's duty ("must call").
CALLER = {
    "fsdp.shard_layers | Every rank must call it on the same model, in the same state: the units shard what each rank holds.": "every check builds its model from one seed on every rank before shard_layers",
}


def _functions(path):
    """(qualified name, node, its lines) of each function that holds a part students write."""
    with open(path) as f:
        source = f.read()
    lines = source.splitlines()

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef):
                body = lines[child.lineno - 1 : child.end_lineno]
                if any(BEGIN in line for line in body):
                    yield prefix + child.name, child, body

    yield from walk(ast.parse(source), "")


def _todo(body) -> str:
    """The TODO comments of a function: each `# TODO(exercise N):` line and the comment lines under it."""
    said, inside = [], False
    for line in map(str.strip, body):
        if line.startswith("# TODO(exercise"):
            said.append(line.split(":", 1)[1] if ":" in line else "")
            inside = True
        elif inside and line.startswith("#") and not line.startswith("###"):
            said.append(line[1:])
        else:
            inside = False
    return " ".join(said)


def _promises(text):
    text = re.sub(r"\s+", " ", text).strip()
    return [s for s in re.split(r"(?<=[.:;!?])\s+(?=[A-Z(\"'`])", text) if any(m in s.lower() for m in MARKED)]


def promises() -> list:
    """Every marked sentence of the student files, as "module.function | sentence"."""
    found = []
    for file in STUDENT_FILES:
        for name, node, body in _functions(os.path.join(SOLUTIONS, file)):
            for sentence in _promises(ast.get_docstring(node) or "") + _promises(_todo(body)):
                found.append(f"{file[: -len('.py')]}.{name} | {sentence}")
    return found


def _checks(target: str) -> str | None:
    """Why target names nothing that checks; None where it does."""
    if target.startswith("contract "):
        _, function, kind = target.split(" ")
        contract = next((c for c in CONTRACTS if c.function == function), None)
        if contract is None:
            return f"no contract of {function} in checks/contracts.py"
        return None if getattr(contract, kind, None) else f"the contract of {function} declares no {kind}"
    module, _, check = target.partition(".")
    try:
        found = getattr(importlib.import_module(f"checks.{module}"), check, None)
    except ImportError:
        return f"no module checks/{module}.py"
    return None if callable(found) else f"no check {check} in checks/{module}.py"


def test_every_marked_sentence_is_checked():
    unmapped = [p for p in promises() if p not in PROMISES and p not in CALLER]
    assert not unmapped, "promises that no contract or check names (add each to PROMISES):\n" + "\n".join(unmapped)


def test_every_mapping_names_a_check_or_a_contract():
    wrong = {p: why for p, target in PROMISES.items() if (why := _checks(target))}
    assert not wrong, wrong


def test_no_mapping_outlives_its_sentence():
    found = set(promises())
    stale = [p for p in [*PROMISES, *CALLER] if p not in found]
    assert not stale, "sentences no student file says any more:\n" + "\n".join(stale)


@pytest.mark.parametrize("sentence", sorted(CALLER))
def test_a_callers_duty_is_worded_as_one(sentence):
    assert " must call " in sentence and CALLER[sentence], sentence
