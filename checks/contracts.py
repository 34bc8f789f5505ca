"""What each student function promises, written down as data, and the one reader that checks it.

A hand-picked case checks what someone thought of; a contract checks what the docstring says. Each
entry of CONTRACTS declares one function's promises in a few fields, the reader makes the cases
(`cases`), a probe runs them in the workers (`probe`) and the judge holds every result to the
declaration (`check_contracts`), with a sentence that names the promise in the student's words:
"evaluate returned a Tensor; it must return a float". An exercise's check `test_contracts` runs its
contracts in one world per world size, the sizes its other checks keep already.

The kinds of promise:
- returns: the exact type ("float" is a Python float, not a tensor; "bool" is True or False, not
  1.0); "list of float" is a list whose items are each a float.
- within_tolerance: "compare with torch.allclose": a case whose ranks differ by less than allclose's
  tolerance must count as equal.
- frozen: "every parameter", frozen ones too: tried on a model with a frozen parameter
  (requires_grad=False, so no .grad): it must not fail on it, and a comparison of parameters must
  count ranks that differ in it alone as different.
- world_sizes: the worlds it must handle, the smallest legal one (a world of 1) among them.
- smallest: the smallest legal value of an argument ({"micro_batches": 1}).
- syncs: "every parameter and every buffer, on every rank": tried on a model with a frozen parameter
  (requires_grad=False), a non-persistent buffer, and values that differ by rank.
- in_place: what it must change in the tensors it was given, not in new ones: checked by identity
  (the same tensor objects, at the same storage) after the call.
- dtypes: the input dtypes it must handle and keep: float32, float64 and bfloat16 where a dtype is
  promised ("the dtype", "bytes of gradients"); for a comparison, equal parameters of each dtype.
- group: it must use the group it is given: tried on a group of its own (dist.new_group), and every
  collective it starts must go there, not to the default group.

tests/authoring/test_contracts.py walks the student files' docstrings and TODOs: a sentence that makes one of
these promises must name an entry here or a named check (PROMISES), or wait in PENDING.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from checks.helpers import CONFIG, PlainSGD, SmallMLP, alone, global_batch, keyed, load, world
from course.grading.points import said
from course.runtime.instrument import unchecked_group


@dataclass(frozen=True)
class Contract:
    exercise: int
    function: str  # as the student file names it: "mlp.evaluate", "sync.SyncBatchNorm1d.update_running_stats"
    call: str  # the name of this module's function that calls it on one case (a probe's part)
    returns: str = ""  # the exact type promised: "float", "bool", "int", "list of float"; "" for none
    # The worlds it is tried in: the grader deals the checks in turn to two processes (course/grading/plugin.py), so
    # test_contracts shares the world of the check two before it in its file, where that one's size is here.
    world_sizes: tuple = (2,)
    within_tolerance: bool = False  # "compare with torch.allclose"
    frozen: bool = False  # every parameter, frozen ones too (no .grad; a comparison counts them)
    smallest: dict = field(default_factory=dict)  # the smallest legal value of each argument named
    syncs: bool = False  # every parameter and every buffer, on every rank, from rank 0
    in_place: tuple = ()  # what it must change in place, by name; ("*",): every tensor of the model it is given
    dtypes: tuple = ()  # the input dtypes it must handle and keep, by name: "float64"
    group: bool = False  # it must use the group it is given
    alone: bool = False  # tried as a script runs it alone, with no process group (world_sizes: (1,))

    @property
    def name(self) -> str:
        """As the student calls it: "evaluate", "MyDP(model)" for a constructor."""
        *_, owner, name = self.function.split(".")
        return f"{owner}(model)" if name == "__init__" else name


DTYPES = ("float32", "float64", "bfloat16")

CONTRACTS = (
    Contract(1, "mlp.evaluate", "_evaluate", returns="float", world_sizes=(1,), alone=True),
    Contract(2, "dist.par_matmul_by_row", "_by_row", world_sizes=(3,), dtypes=DTYPES),
    Contract(2, "dist.par_matmul_by_reduction", "_by_reduction", world_sizes=(3,), dtypes=DTYPES),
    Contract(
        3,
        "mlp.check_parameter_closeness",
        "_closeness",
        returns="bool",
        world_sizes=(1, 3),
        within_tolerance=True,
        frozen=True,
        dtypes=DTYPES,
    ),
    Contract(4, "mydp.MyDP.__init__", "_mydp_start", syncs=True),
    Contract(6, "mydp.bucket_parameters", "_buckets", dtypes=DTYPES[1:]),
    Contract(6, "mydp.OverlappedDP.__init__", "_overlapped_start", syncs=True),
    Contract(7, "mydp.accumulation_step", "_accumulation_step", returns="float", smallest={"micro_batches": 1}),
    Contract(
        9,
        "sync.SyncBatchNorm1d.update_running_stats",
        "_running_stats",
        in_place=("running_mean", "running_var"),
    ),
    Contract(10, "hvd.broadcast_parameters", "_broadcast_parameters", world_sizes=(3,), syncs=True, in_place=("*",)),
    Contract(11, "zero.bf16_average_hook", "_hook_on_a_group", group=True),
    Contract(11, "zero.ShardedOptimizer.step", "_sharded_frozen", frozen=True),
)


def of_exercise(exercise: int) -> list:
    return [c for c in CONTRACTS if c.exercise == exercise]


# --- the cases: what the reader makes of each declaration ---------------------------------------------


def cases(contract: Contract, world_size: int) -> list:
    """The cases of a contract in a world of world_size, as dicts of plain data: each names what it
    tries ("plain", "within tolerance", "smallest micro_batches", "float64 inputs") and what the judge expects of it."""
    if contract.dtypes and contract.returns != "bool":  # a function that makes tensors: one case per dtype
        return [{"case": f"{dtype} inputs", "dtype": dtype} for dtype in contract.dtypes]
    found = [{"case": "plain"}]
    if contract.within_tolerance and world_size > 1:
        found.append({"case": "within tolerance", "expected": True})
    if contract.frozen and contract.returns == "bool" and world_size > 1:  # a comparison of the parameters
        found.append({"case": "a frozen parameter differs", "expected": False})
    for argument, value in contract.smallest.items():
        found.append({"case": f"smallest {argument}", argument: value})
    if world_size > 1:  # a comparison: parameters of every other dtype, equal on every rank
        found += [{"case": f"equal {d} parameters", "dtype": d, "expected": True} for d in contract.dtypes[1:]]
    return found


def kind_of(value) -> str:
    """A value's type in the student's words: "float", "Tensor", "list of float"."""
    if isinstance(value, torch.Tensor):
        return "Tensor"
    if isinstance(value, (list, tuple)):
        kinds = sorted({kind_of(item) for item in value})
        return f"{type(value).__name__} of {' and '.join(kinds)}" if kinds else f"empty {type(value).__name__}"
    return "None" if value is None else type(value).__name__


def _a(kind: str) -> str:
    return kind if kind == "None" else ("an " if kind[0] in "aeiou" else "a ") + kind


def sync_model(rank: int) -> nn.Module:
    """A model that holds what "every parameter and every buffer" is easiest to forget with: a frozen
    parameter (requires_grad=False) and a non-persistent buffer (not in state_dict), each of a value of
    its own on each rank (rank + its seed), as every other tensor."""
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    model[0].bias.requires_grad_(False)
    model.register_buffer("scale", torch.full((2,), float(rank) + 1), persistent=False)
    model[1].running_mean.fill_(float(rank) + 0.5)
    return model


def named_state(model: nn.Module) -> dict:
    """Every parameter and every buffer of model, by name, non-persistent ones included."""
    return dict(model.named_parameters()) | dict(model.named_buffers())


def _frozen_or_hidden(model: nn.Module) -> dict:
    """What makes a tensor of sync_model easy to forget, by name."""
    persistent = set(model.state_dict())
    kinds = {n: "a frozen parameter" for n, p in model.named_parameters() if not p.requires_grad}
    return kinds | {n: "a non-persistent buffer" for n, _ in model.named_buffers() if n not in persistent}


# --- the calls: one per contract, in a probe ------------------------------------------------------------
# Each returns {"result": what the function returned, ...what the judge needs of the case}.


def _evaluate(ex, case):
    torch.manual_seed(0)
    model = SmallMLP()
    x, y = global_batch(CONFIG, 0, 2)
    return {"result": ex.mlp.evaluate(model, (x, y), batch_size=8)}


def _closeness(ex, case):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).to(getattr(torch, case.get("dtype", "float32")))
    last = dist.get_rank() == dist.get_world_size() - 1
    if case["case"] == "within tolerance" and last:
        with torch.no_grad():  # far inside allclose's rtol of 1e-5, yet not equal in float32
            model[2].weight.mul_(1 + 1e-6)
    if case["case"] == "a frozen parameter differs":
        model[0].bias.requires_grad_(False)
        if last:
            with torch.no_grad():
                model[0].bias.add_(1.0)
    return {"result": ex.mlp.check_parameter_closeness(model)}


def _accumulation_step(ex, case):
    torch.manual_seed(0)
    model = ex.mydp.OverlappedDP(SmallMLP(), bucket_cap_mb=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=CONFIG.lr)
    x, y = global_batch(CONFIG, 0, 1)
    return {"result": ex.mydp.accumulation_step(model, optimizer, x, y, case.get("micro_batches", 2))}


def _running_stats(ex, case):
    layer = ex.sync.SyncBatchNorm1d(3)
    held = [layer.running_mean, layer.running_var]
    pointers = [t.data_ptr() for t in held]
    count, mean, var = torch.tensor([4.0]), torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 1.0, 2.0])
    before = [t.clone() for t in held]
    result = layer.update_running_stats(count, mean, var)
    now = [layer.running_mean, layer.running_var]
    unchanged = [n for n, b, t in zip(("running_mean", "running_var"), before, now) if torch.equal(b, t)]
    changed = [name for name, a, b, p in zip(("running_mean", "running_var"), held, now, pointers) if a is not b]
    moved = [name for name, b, p in zip(("running_mean", "running_var"), now, pointers) if b.data_ptr() != p]
    return {"result": result, "replaced": sorted(set(changed) | set(moved)), "unchanged": unchanged}


def _started(wrap):
    model = sync_model(dist.get_rank())
    wrap(model)
    return {"result": None, "state": {n: t.detach().clone() for n, t in named_state(model).items()}}


def _mydp_start(ex, case):
    return _started(ex.mydp.MyDP)


def _overlapped_start(ex, case):
    return _started(ex.mydp.OverlappedDP)


def _broadcast_parameters(ex, case):
    model = sync_model(dist.get_rank())
    held = named_state(model)
    pointers = {n: t.data_ptr() for n, t in held.items()}
    result = ex.hvd.broadcast_parameters(model)
    now = named_state(model)
    replaced = [n for n in held if now.get(n) is not held[n] or now[n].data_ptr() != pointers[n]]
    return {"result": result, "replaced": replaced, "state": {n: t.detach().clone() for n, t in now.items()}}


def _matrices(dtype):
    """A (5 x 7) and B (7 x 3) of this dtype on rank 0, None on the others: 5 and 7 divide by no world."""
    if dist.get_rank() != 0:
        return None, None
    g = torch.Generator().manual_seed(11)
    dtype = getattr(torch, dtype)
    return torch.randn(5, 7, generator=g).to(dtype), torch.randn(7, 3, generator=g).to(dtype)


def _by_row(ex, case):
    product = ex.dist.par_matmul_by_row(*_matrices(case["dtype"]))
    return {"result": product, "dtype": _dtype(product), "due": dist.get_rank() == 0}  # None elsewhere


def _by_reduction(ex, case):
    product = ex.dist.par_matmul_by_reduction(*_matrices(case["dtype"]))
    return {"result": product, "dtype": _dtype(product), "due": True}


def _dtype(value):
    return str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else None


CAP_BYTES = 160  # two float64 parameters of 10 elements, five of 4 bytes each per element


def _buckets(ex, case):
    params = [nn.Parameter(torch.zeros(10, dtype=getattr(torch, case["dtype"]))) for _ in range(5)]
    buckets = ex.mydp.bucket_parameters(params, CAP_BYTES)
    sizes = [[p.numel() * p.element_size() for p in bucket] for bucket in buckets]
    return {"result": buckets, "bytes": sizes}


def _sharded_frozen(ex, case):
    """A step of ShardedOptimizer over a model whose first layer is frozen (its .grad None on every rank)."""
    torch.manual_seed(0)
    model = SmallMLP()
    frozen = next(iter(model.parameters())).requires_grad_(False)
    before = frozen.detach().clone()
    optimizer = ex.zero.ShardedOptimizer(model.parameters(), PlainSGD, lr=0.1)  # no torch._dynamo to import
    x, y = global_batch(CONFIG, 0, 1)
    model(x, y)[1].backward()
    try:
        optimizer.step()
    except (AttributeError, TypeError, ValueError, RuntimeError) as error:  # on every rank alike
        return {"result": None, "raised": f"{type(error).__name__}: {str(error)[:120]}"}
    return {"result": None, "raised": None, "frozen_changed": not torch.equal(frozen.detach(), before)}


def _hook_on_a_group(ex, case):
    group = unchecked_group(use="given")  # a group of its own, as a caller hands one
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(SmallMLP(), process_group=group)
    model.register_comm_hook(group, ex.zero.bf16_average_hook)
    used, original = [], dist.ProcessGroup.allreduce

    def noted(pg, *args, **kwargs):
        used.append(pg.group_name == group.group_name)
        return original(pg, *args, **kwargs)

    x, y = global_batch(CONFIG, 0, 1)
    dist.ProcessGroup.allreduce = noted
    try:
        model(x, y)[1].backward()
    finally:
        dist.ProcessGroup.allreduce = original
    return {"result": None, "on_group": used}


def probe(folder, exercise):
    """Probe, on every rank: every case of the exercise's contracts for this world, by contract and case."""
    ex = load(folder)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    found = {}
    for contract in of_exercise(exercise):
        if world_size not in contract.world_sizes:
            continue
        for case in cases(contract, world_size):
            got = globals()[contract.call](ex, case)
            got["result"] = {"kind": kind_of(got["result"]), "value": _plain(got["result"])}
            found[f"{contract.function}: {case['case']}"] = got
    return found


def _plain(value):
    """The value itself where it is plain data the judge reads (a bool, a number); else None."""
    return value if type(value) in (bool, int, float) else None


# --- the judge --------------------------------------------------------------------------------------------


def broken(contract: Contract, case: dict, got: dict, rank: int, world_size: int) -> str | None:
    """The first promise of contract that got (one rank's result of case) breaks, in the student's words;
    None where it keeps them all. Every sentence about a broken contract is worded here."""
    name, kind = contract.name, got["result"]["kind"]
    where = f" (rank {rank} of {world_size}{'' if case['case'] == 'plain' else ', ' + case['case']})"
    if contract.returns and kind != contract.returns:
        return said(
            f"{name} returns another type than its signature says",
            f"{name} returned {_a(kind)}; it must return {_a(contract.returns)}{where}",
        )
    if not contract.returns and kind != "None" and contract.in_place:
        return said(
            f"{name} returns something where it changes its argument in place",
            f"{name} returned {_a(kind)}; it changes what it was given in place and returns None{where}",
        )
    if case["case"] == "a frozen parameter differs" and got["result"]["value"] != case["expected"]:
        return said(
            f"{name} skips frozen parameters",
            f"{name} returned {got['result']['value']!r} for ranks that differ in a frozen parameter"
            f" (requires_grad=False) alone; it must return {case['expected']!r}: every parameter counts, frozen"
            f" ones too{where}",
        )
    if "dtype" in case and "expected" in case and got["result"]["value"] != case["expected"]:
        return said(
            f"{name} wrong on parameters of another dtype than float32",
            f"{name} returned {got['result']['value']!r} for {case['dtype']} parameters that are equal on every rank;"
            f" it must return {case['expected']!r}: what it gathers and compares keeps the parameters' dtype{where}",
        )
    if "expected" in case and got["result"]["value"] != case["expected"]:
        return said(
            f"{name} compares exactly where torch.allclose is asked",
            f"{name} returned {got['result']['value']!r} for ranks whose parameters differ by far less than"
            f" torch.allclose's tolerance; it must return {case['expected']!r}: compare with torch.allclose,"
            f" not exactly{where}",
        )
    if contract.dtypes and got.get("due") and got["dtype"] is None:
        return said(
            f"{name} returns no product",
            f"{name} returned {_a(kind)} where the product is due{where}",
        )
    if contract.dtypes and got.get("dtype") not in (None, case.get("dtype")):
        return said(
            f"{name} does not keep its inputs' dtype",
            f"{name} returned a {got['dtype']} tensor for {case['dtype']} inputs; it must keep the inputs' dtype,"
            f" which share_shapes tells every rank{where}",
        )
    too_full = [b for b in got.get("bytes", []) if len(b) > 1 and sum(b) > CAP_BYTES]
    if contract.dtypes and too_full:
        return said(
            f"{name} over cap_bytes for gradients of another dtype than float32",
            f"{name} put {sum(too_full[0])} bytes of {case['dtype']} gradients in one bucket, cap_bytes={CAP_BYTES}:"
            f" a bucket holds at most cap_bytes, and a gradient takes element_size() bytes per element{where}",
        )
    if contract.frozen and got.get("raised"):
        return said(
            f"{name} fails on a frozen parameter",
            f"{name} raised {got['raised']} on a model with a frozen parameter (requires_grad=False: its .grad is"
            f" None on every rank): a function that walks the parameters meets frozen ones{where}",
        )
    if contract.frozen and got.get("frozen_changed"):
        return said(
            f"{name} changes a frozen parameter",
            f"{name} changed a frozen parameter (requires_grad=False): it trains only what has a gradient{where}",
        )
    if contract.group and not (got["on_group"] and all(got["on_group"])):
        return said(
            f"{name} ignores the group it is given",
            f"{name} all-reduced on another group than the one DDP called it with: its collectives go to that"
            f" group (and its size is that group's){where}",
        )
    if contract.in_place and got.get("unchanged"):
        return said(
            f"{name} leaves what it must update as it was",
            f"{name} left {', '.join(got['unchanged'])} as they were: it must update them, in place{where}",
        )
    if contract.in_place and got.get("replaced"):
        return said(
            f"{name} replaces tensors it must change in place",
            f"{name} put new tensors in place of {', '.join(got['replaced'])}: it must change the tensors the"
            f" model holds in place (an optimizer, or a caller, holds those){where}",
        )
    return None


def _unsynced(contract: Contract, results: list, world_size: int) -> str | None:
    """Where a rank's state after the call is not rank 0's, naming what the tensor is."""
    kinds = _frozen_or_hidden(sync_model(0))
    for rank, got in enumerate(results):
        for key, one in got.items():
            if not key.startswith(contract.function + ":"):
                continue
            for name, value in one["state"].items():
                if not torch.equal(value, results[0][key]["state"][name]):
                    what = f"{name} ({kinds[name]})" if name in kinds else name
                    return said(
                        f"{contract.name} not every parameter and every buffer",
                        f"after {contract.name}, rank {rank}'s {what} is not rank 0's: every parameter and every"
                        f" buffer, frozen and non-persistent ones too, must be rank 0's (world of {world_size})",
                    )
    return None


def check_contracts(folder, exercise):
    """Every declared promise of the exercise's functions, case by case, in each world they are tried in."""
    sizes = sorted({w for c in of_exercise(exercise) for w in c.world_sizes})
    for world_size in sizes:
        if all(c.alone for c in of_exercise(exercise) if world_size in c.world_sizes):
            results = [alone(probe, folder, exercise, expect=keyed(dict))]  # the world exercise 1's checks keep
        else:
            results = world(probe, world_size, folder, exercise, expect=keyed(dict))
        for contract in of_exercise(exercise):
            if world_size not in contract.world_sizes:
                continue
            for case in cases(contract, world_size):
                key = f"{contract.function}: {case['case']}"
                for rank, got in enumerate(results):
                    assert key in got, f"rank {rank} returned no result for {key}"
                    sentence = broken(contract, case, got[key], rank, world_size)
                    assert sentence is None, sentence
            if contract.syncs:
                sentence = _unsynced(contract, results, world_size)
                assert sentence is None, sentence


def assert_returns(function: str, value, rank: int = 0, world_size: int = 1):
    """In a judge that reads a function's result: its declared type first, so that a wrong type is named
    as such before any later comparison blames something else."""
    contract = next(c for c in CONTRACTS if c.function == function)
    got = {"result": {"kind": kind_of(value), "value": _plain(value)}}
    sentence = broken(contract, {"case": "plain"}, got, rank, world_size)
    assert sentence is None, sentence
