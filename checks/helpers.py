"""Small pieces shared by the exercise checks.

Every check is a probe and a judge. The probe runs in worker processes (course.launch.run): it
loads the implementation under test, runs it, and returns data only (tensors, numbers, strings,
and lists and dicts of those). The judge runs in the grading process, which never imports the
code under test: it compares that data with what it computes itself, from first principles or
with the tests' own model below, or with what torch's own parallelism computes in a world where no
code under test ever ran (reference_world()). So code under test can do what it likes in its
workers, and a verdict is still decided only by code of this repository and torch.
"""

import dataclasses
import importlib.abc
import importlib.machinery
import math
import os
import sys
from contextlib import redirect_stdout
from io import StringIO
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course import exercises, impl
from course.grading.points import said
from course.launch import Observed, run
from course.runtime import uprobes
from course.runtime.uprobes import ENTRIES
from course.runtime.workers import for_credit, stop_kept

# Small enough that a multi-rank check takes a fraction of a second; 144 training rows divide
# into batches of 8 and of 16 alike, so one epoch of W ranks matches one epoch of one process.
SMALL = dict(n_layers=3, d_in=12, n_classes=4, d_hidden=10, batch_size=8, train_size=160, niters=12, lr=0.2, seed=3)
CONFIG = SimpleNamespace(**SMALL)
WIDTHS = [CONFIG.d_in, *[CONFIG.d_hidden] * (CONFIG.n_layers - 1), CONFIG.n_classes]  # of exercise 1's layers


def small_config(mlp, **changes):
    """SMALL as the ModelConfig of the implementation under test (in a worker)."""
    return mlp.ModelConfig(**(SMALL | changes))


def load(folder):
    """The implementation under test; call it only in a probe, never in a judge."""
    return impl.load(folder)


class SmallMLP(nn.Module):
    """The tests' own MLP, the same as exercise 1's: what the wrapper checks train, in the workers
    and in the judge alike, so a data-parallel exercise is judged apart from exercise 1."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(WIDTHS, WIDTHS[1:]))

    def forward(self, data, targets=None):
        logits = forward_from([layer.weight for layer in self.layers], data)
        return logits, (F.cross_entropy(logits, targets) if targets is not None else None)


def parameters_of(model, item=torch.Tensor):
    """The shape of a result that holds one item per parameter of model, by name (many(), keyed())."""
    return keyed(item, [name for name, _ in model.named_parameters()])


def forward_from(weights, x):
    """Exercise 1's forward pass from its weight matrices: tanh between the layers, none after the last."""
    for i, weight in enumerate(weights):
        x = x @ weight.T
        if i < len(weights) - 1:
            x = torch.tanh(x)
    return x


# --- what a probe returns, as its judge expects it ------------------------------------------------
#
# A worker's reply is data that the judge validates, never a claim it believes: the worker's process
# runs the submission, which can rewrite what it sends back (an empty list where the probe failed, a
# dict without the part a judge reads). world() and alone() check every rank's result against the
# shape its judge declares (expect=) before any judge reads it, so that a malformed part fails the
# check with what came back and what was expected, and no judge passes by iterating over nothing.
# A shape is: a type (torch.Tensor, int, float, str, bool; a float and a floating tensor must be
# finite), None, tensor(shape, dtype, finite), a tuple of shapes (a list or tuple of exactly those
# items), a dict of shapes (a dict with at least those keys), many(shape, n), keyed(shape, keys),
# maybe(shape) or either(*shapes); object where the judge itself tells apart what may come (and says
# what is wrong with each).


class _Many:
    def __init__(self, item, n):
        self.item, self.n = item, n


class _Keyed:
    def __init__(self, item, keys):
        self.item, self.keys = item, None if keys is None else list(keys)


class _Maybe:
    def __init__(self, item):
        self.item = item


class _Either:
    def __init__(self, shapes):
        self.shapes = shapes


class _Tensor:
    def __init__(self, shape, dtype, finite):
        self.shape, self.dtype, self.finite = None if shape is None else list(shape), dtype, finite


def many(item, n=None):
    """A list (or tuple) of n items (n an int, or a range of numbers; any number without n), each of the
    shape item."""
    return _Many(item, n)


def keyed(item, keys=None):
    """A dict whose values are of the shape item, with exactly these keys (any, without keys)."""
    return _Keyed(item, keys)


def maybe(item):
    """None, or the shape item."""
    return _Maybe(item)


def either(*shapes):
    """Any of these shapes (a probe that stops early says why in fewer parts); the last is the whole one."""
    return _Either(shapes)


def tensor(shape=None, dtype=None, finite=True):
    """A tensor of this shape and dtype (either left out: any), of finite values if floating (unless finite is
    False: where the judge compares it with its own numbers first, and names the mistake that gave nan or inf)."""
    return _Tensor(shape, dtype, finite)


# One tensor per parameter of exercise 1's MLP (and SmallMLP), by name: a state dict of SMALL.
SMALL_NAMES = [f"layers.{i}.weight" for i in range(CONFIG.n_layers)]
SMALL_PARAMETERS = keyed(torch.Tensor, SMALL_NAMES)

_KINDS = {int: "a whole number", float: "a finite number", str: "a string", bool: "True or False"}


def _items(n) -> str:
    return f"{n} item" if n == 1 else f"{n} items"


def _expected(shape) -> str:
    """The shape of a result, in words."""
    if shape is None:
        return "None"
    if shape is torch.Tensor:
        return _expected(tensor())
    if isinstance(shape, _Tensor):
        dtype = f" {str(shape.dtype).removeprefix('torch.')}" if shape.dtype is not None else ""
        finite = " of finite values" if shape.finite else ""
        return f"a{dtype} tensor{f' of shape {shape.shape}' if shape.shape is not None else ''}{finite}"
    if isinstance(shape, type):
        return _KINDS.get(shape, shape.__name__)
    if isinstance(shape, tuple):
        return f"a list of {_items(len(shape))}"
    if isinstance(shape, dict):
        return f"a dict with keys {sorted(shape)}"
    if isinstance(shape, _Many):
        if isinstance(shape.n, range):
            return f"a list of {shape.n.start} to {shape.n.stop - 1} items"
        return f"a list of {_items(shape.n)}" if shape.n is not None else "a list"
    if isinstance(shape, _Keyed):
        return f"a dict with keys {shape.keys}" if shape.keys is not None else "a dict"
    if isinstance(shape, _Either):
        return _expected(shape.shapes[-1])
    return f"None or {_expected(shape.item)}"


def _returned(got) -> str:
    """What came back, in words."""
    if got is None or isinstance(got, (bool, int, float)):
        return repr(got)
    if isinstance(got, torch.Tensor):
        finite = got.is_floating_point() and not torch.isfinite(got).all()
        return f"a {str(got.dtype).removeprefix('torch.')} tensor of shape {list(got.shape)}" + (
            " holding nan or inf" if finite else ""
        )
    if isinstance(got, str):
        return "a string"
    if isinstance(got, (list, tuple)):
        return f"a list of {_items(len(got))}" if got else "an empty list"
    if isinstance(got, dict):
        return f"a dict with keys {sorted(map(str, got))}"
    return f"a {type(got).__name__}"


def _lengths(shape) -> range:
    if isinstance(shape, tuple):
        return range(len(shape), len(shape) + 1)
    return (
        shape.n if isinstance(shape.n, range) else range(2**63 - 1) if shape.n is None else range(shape.n, shape.n + 1)
    )


def _fits(got, shape) -> bool:
    if shape is object:  # any data: the judge tells its kinds apart itself
        return True
    if shape is None:
        return got is None
    if shape is torch.Tensor:
        return _fits(got, tensor())
    if isinstance(shape, _Tensor):
        return (
            isinstance(got, torch.Tensor)
            and (shape.shape is None or list(got.shape) == shape.shape)
            and (shape.dtype is None or got.dtype == shape.dtype)
            and not (shape.finite and got.is_floating_point() and not torch.isfinite(got).all())
        )
    if shape is float:
        return type(got) in (int, float) and math.isfinite(got)
    if isinstance(shape, type):
        return type(got) is shape
    if isinstance(shape, (tuple, _Many)):
        return isinstance(got, (list, tuple)) and len(got) in _lengths(shape)
    if isinstance(shape, dict):
        return isinstance(got, dict) and set(shape) <= set(got)
    if isinstance(shape, _Keyed):
        return isinstance(got, dict) and (shape.keys is None or set(got) == set(shape.keys))
    return got is None or _fits(got, shape.item)


def _parts(got, shape):
    """(key, part, its shape) of a result that fits the outer shape."""
    if isinstance(shape, tuple):
        return zip(range(len(shape)), got, shape)
    if isinstance(shape, _Many):
        return ((i, part, shape.item) for i, part in enumerate(got))
    if isinstance(shape, dict):
        return ((key, got[key], part) for key, part in shape.items())
    if isinstance(shape, _Keyed):
        return ((key, part, shape.item) for key, part in got.items())
    if isinstance(shape, _Maybe) and got is not None:
        return [(None, got, shape.item)]
    return []


def malformed(got, shape, path=""):
    """Why got is not of the shape, or None where it is: (what came back, what the check expects, where in
    got: a path of keys and indices, '' for got itself)."""
    if isinstance(shape, _Either):
        found = [malformed(got, one, path) for one in shape.shapes]
        return None if None in found else found[-1]
    if not _fits(got, shape):
        return _returned(got), _expected(shape), path
    for key, part, inner in _parts(got, shape):
        found = malformed(part, inner, path if key is None else f"{path}[{key!r}]")
        if found:
            return found
    return None


def validated(results, shape, world_size, forbids=()):
    """results (by rank), each checked against shape: a malformed one fails the check, saying what came back.
    An Observed (run's observe) is returned as it came, its results checked; first, that the kernel counted no
    call of forbids (not_called): the mistake to name, where a result's shape is a consequence of it."""
    if isinstance(results, Observed):
        not_called(results.calls, forbids)
        return dataclasses.replace(results, results=validated(results.results, shape, world_size))
    for rank, got in enumerate(results):
        found = malformed(got, shape)
        if found is None:
            continue
        returned, expected, path = found
        where = [f"rank {rank} of {world_size}"] * (world_size > 1) + [f"at {path} of its result"] * bool(path)
        raise AssertionError(
            said(
                "the submission returned data of another shape than the check asks for",
                f"the submission returned {returned} where the check expects {expected}"
                + (f" ({', '.join(where)})" if where else ""),
            )
        )
    return results


class Given:
    """What a judge gives each rank its own part of (world()'s per_rank): made by ``make`` only once the
    world's processes run, so that none of them was forked while the grader held every rank's part (each
    would hold them all, in memory its submission can search); ``split`` makes each rank's arguments of it.
    ``value``: the whole input that ``make`` built, for the judge; ``parts``: each rank's arguments (a reference world's too)."""

    def __init__(self, make, split):
        self.make, self.split, self.value, self.parts = make, split, None, None

    def __call__(self) -> list:
        self.value = self.make()
        self.parts = self.split(self.value)
        return self.parts


def drawn(seed):
    """The generator of a check's inputs: seeded with seed, so that a student sees the same feedback at each
    run; where the grade counts (for_credit()), seeded by the operating system as the check runs, so that
    no submission knows the inputs before it is given them (the probe receives them: world's per_rank)."""
    chosen = int.from_bytes(os.urandom(8), "little") if for_credit() else seed
    return torch.Generator().manual_seed(chosen)


def world(fn, world_size, *args, expect, keep=True, debug=True, observe=False, allows=(), **options):
    """Run the probe fn on every rank of a gloo world; what it returned, by rank, each checked against
    the shape expect (validated: what the judge reads is what it asked for). Collectives are
    checked (debug: each is compared across the ranks before it starts, course/runtime/instrument.py), whatever
    COURSE_DEBUG says, unless debug is False (a check of hundreds of collectives whose ranks an earlier
    check compared). The workers are sandboxed (course/runtime/sandbox.py): every world that runs submission
    code comes from here or alone(). The world is kept for the next probe of its size and options
    (course/runtime/workers.py says what each call gets afresh) unless keep is False; options go to run()
    (timeout, ...). With observe=True, run's Observed: the validated results with what the kernel counted.
    Where the running check's exercise forbids a part of torch (forbidden()), the kernel's count of its use
    fails the check if any rank made one (not_called); where the kernel does not count it (_counted_here), the
    probe's own process says what it saw (_watching), for the student's own feedback. allows: those of them that
    this check's probe asks for (exercise 13 writes its checkpoint's pieces as DTensors)."""
    forbids = tuple(name for name in forbidden() if name not in allows)
    counts = tuple(name for name in forbids if _counted_here(name))
    counted = bool(counts)
    watched = tuple(name for name in forbids if name not in counts)
    # The modules of those parts that this process holds, and so a rank forked from it before the call: not its own.
    held = {name: uprobes.held(ENTRIES[name]) for name in watched}
    got = validated(
        run(
            _watching if watched else fn,
            world_size,
            *((held, fn, *args) if watched else args),
            keep=keep,
            sandbox=True,
            debug=debug,
            observe=observe or counted,
            count_calls=counts,
            **options,
        ),
        (object, {name: int for name in watched}) if watched else expect,
        world_size,
        counts,
    )
    if counted and not observe:
        got = got.results
    # The forbidden part is the mistake to name first: what it returned may be of another shape because of it.
    return validated(_none_seen(got), expect, world_size) if watched else got


def forbidden() -> tuple:
    """What the running check's exercise forbids (course/exercises.py's forbids): that of the checks module
    nearest on the stack, whoever runs the check (the grader, a notebook's checks, a mutant test)."""
    frame = sys._getframe(1)
    while frame is not None:
        exercise = exercises.of_checks_module(frame.f_globals.get("__name__", ""))
        if exercise is not None:
            return exercise.forbids
        frame = frame.f_back
    return ()


def not_called(calls, forbids):
    """Judge the kernel's count of a call's entries into torch (Observed's calls): no rank made any of forbids.
    None (the kernel counts none here: no root, no uprobes) judges nothing."""
    for (rank, name), count in sorted((calls or {}).items()):
        assert name not in forbids or count == 0, _torch_own_used(
            rank, name, f"the kernel counted {ENTRIES[name].seen(count)}"
        )


def _torch_own_used(rank, name, seen):
    """The sentence of a forbidden part of torch (ENTRIES[name]) used on rank, seen as `seen` says."""
    entry = ENTRIES[name]
    return said(
        f"{entry.called} used where the exercise writes it by hand",
        f"rank {rank}'s processes used {entry.called}: {seen} while the check ran; this exercise is to write it"
        " by hand, so torch's own earns nothing here",
    )


def _counted_here(name) -> bool:
    """Whether the kernel counts torch's own `name` for this check: where it counts calls for this process, and, for
    a part in Python only (imported once in a process), where every call runs in a process of its own (for credit).
    Where it does not, the probe's process watches for it (_watching)."""
    return uprobes.available((name,)) and (not ENTRIES[name].paths or for_credit())


def _watching(held, fn, *args):
    """Probe: fn(*args), and what this process saw of each of torch's parts that held names: the objects it made of
    a part made in C++ (_MADE: each DistributedDataParallel, each DTensor); the modules of a part in Python only it
    holds beyond held's (the grader's, which it was forked with). A student's own feedback where the kernel does not
    count every call (code under test can hide these from this process, never from the kernel, which grades for
    credit rest on)."""
    names = tuple(held)
    made = {name: [] for name in names}
    undo = [_counting(*_MADE[name], made[name]) for name in names if name in _MADE]
    try:
        result = fn(*args)
    finally:
        for step in undo:
            step()
    seen = {
        name: len(uprobes.held(ENTRIES[name]) - held[name]) if ENTRIES[name].paths else len(made[name])
        for name in names
    }
    return result, seen


# Where each part of torch that the kernel counts in C++ makes its objects: the module, the class, its method.
_MADE = {
    "DistributedDataParallel": ("torch.nn.parallel.distributed", "DistributedDataParallel", "__init__"),
    "DTensor": ("torch.distributed.tensor._api", "DTensor", "__new__"),
}


def _counting(module_name, class_name, method, made):
    """Add to made each call of the class's method from now on, the module's class wrapped now if it is loaded,
    else once something imports it (a finder first on sys.meta_path: DTensor's module takes seconds to import, and
    only code that uses it does). Returns what undoes it."""

    def wrap(module):
        cls = getattr(module, class_name)
        kept = cls.__dict__[method]
        original = getattr(cls, method)

        def counted(*args, **kwargs):
            made.append(1)
            return original(*args, **kwargs)

        setattr(cls, method, staticmethod(counted) if method == "__new__" else counted)
        undo.append(lambda: setattr(cls, method, kept))

    def undo_all():
        for step in reversed(undo):
            step()

    undo = []
    if module_name in sys.modules:
        wrap(sys.modules[module_name])
    else:
        finder = _WhenImported(module_name, wrap)
        sys.meta_path.insert(0, finder)
        undo.append(lambda: sys.meta_path.remove(finder))
    return undo_all


class _WhenImported(importlib.abc.MetaPathFinder):
    """Calls then(module) once the module named name is imported (the import system's own finders find it)."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                self.then(module)

            spec.loader.exec_module = exec_module
        return spec


def _none_seen(got):
    """got's results without _watching's counts; fails where a rank was seen using one."""
    results = got.results if isinstance(got, Observed) else got
    if any(count and ENTRIES[name].paths for _, seen in results for name, count in seen.items()):
        stop_kept()  # its ranks hold the part now: the next call (a corrected submission's) gets ranks that do not
    for rank, (_, seen) in enumerate(results):
        for name, count in sorted(seen.items()):
            what = f"{' and '.join(ENTRIES[name].modules)} imported" if ENTRIES[name].paths else f"{count} made"
            assert count == 0, _torch_own_used(rank, name, f"the check saw {what}")
    results = [result for result, _ in results]
    return dataclasses.replace(got, results=results) if isinstance(got, Observed) else results


def reference_world(fn, world_size, *args, expect, per_rank=None):
    """Run the probe fn, which loads no code under test (it computes what a judge compares with: torch's own
    DDP, ZeroRedundancyOptimizer, ...), on every rank of a world that never loaded any (course/runtime/workers.py's
    reference worlds): a submission that patched torch or these checks in its own worlds cannot forge it. What
    it returned, by rank, checked against the shape expect (validated)."""
    return validated(
        run(fn, world_size, *args, keep=True, debug=True, reference=True, per_rank=per_rank), expect, world_size
    )


def judged() -> bool:
    """Whether a check also runs cases drawn as it grades (drawn()), judged by the reference solutions
    (judge_world()): where the grade counts. The cases that the checks' own tables hold, a student's copy
    holds too, answers and all; these none could know. Raises where the grade counts but the judge's
    folder is missing (course/impl.py's judge()): a grade for credit without it would rest on public answers."""
    if not for_credit():
        return False
    if impl.judge() is None:
        raise RuntimeError(
            "grading for credit needs the reference solutions to judge the drawn cases: run it in the instructors'"
            " repository, or set COURSE_JUDGE to a folder that holds them (docs/instructors.md)"
        )
    return True


def judge_world(fn, *args, expect):
    """fn(folder, *args) with folder the reference solutions (course/impl.py's judge()), on one rank of a
    reference world, where no submission ran: the answers a judge compares drawn cases with, computed where
    no submission can read them. A probe of the check's own serves, given the judge's folder for the
    submission's. What it returned, checked against the shape expect (validated)."""
    return reference_world(fn, 1, impl.judge(), *args, expect=expect)[0]


def against_the_judge(got, probe, *cases, expect, what, same=lambda a, b: a == b, shown=str):
    """Judge got, a submission's answers to cases drawn as the grade runs (probe(folder, *cases) in its world),
    against the reference's to the same cases (judge_world(), called after the submission's world gave its
    answers, so that no world of it is forked while the grader holds the reference's): an AssertionError at the
    first that differs, what(k) naming case k, shown(answer) writing an answer."""
    for k, (value, expected) in enumerate(zip(got, judge_world(probe, *cases, expect=expect))):
        assert same(value, expected), said(
            "right on the checks' own cases, not on cases drawn as the grade ran",
            f"{what(k)} is {shown(value)}, not {shown(expected)}, on a case drawn as the grade ran: the checks' own"
            " cases have answers in tables that the students' copy holds too; the rule must hold for any case",
        )


def kernel_counted(observed, least, concept, what, carrying):
    """Judge what the kernel counted of an observed call (world(..., observe=True)): at least `least` bytes over the
    world's own network, what `carrying` (words: "its collectives carry") carries at the least. None (no sandbox
    with a network of its own) judges nothing."""
    carried = observed.loopback_bytes
    assert carried is None or carried >= least, said(
        concept,
        f"{what}: the world's network carried {carried} bytes in all, as the kernel counted them, where {carrying}"
        f" at least {least}",
    )


def _without_process_group(fn, args):
    dist.destroy_process_group()
    try:
        return fn(*args)
    finally:  # the launcher ends every world with a barrier
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def alone(fn, *args, expect):
    """Run the probe fn in one worker process with no process group, as a script run alone
    (mlp.train wraps its model in DDP whenever a process group exists); what it returned, checked
    against the shape expect (validated)."""
    return validated(run(_without_process_group, 1, fn, args, keep=True, sandbox=True), expect, 1)[0]


def printed(fn, *args):
    """fn(*args)'s result and what it printed, in a probe."""
    out = StringIO()
    with redirect_stdout(out):
        result = fn(*args)
    return result, out.getvalue()


def float32_close(got, expected):
    return torch.allclose(got, expected, rtol=1e-3, atol=1e-6)


def close(got, expected):
    """The same shape, and the same numbers up to float32 sums taken in another order."""
    return got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-4, atol=1e-5)


def tanh_block(layers, x):
    """One process's block of two layers given as (weight, bias) pairs, tanh between them."""
    (w0, b0), (w1, b1) = layers
    return F.linear(torch.tanh(F.linear(x, w0, b0)), w1, b1)


def block_outputs(results, given):
    """For computed_with_peers: each rank's output of a tanh_block case given as (its layers, its rows), beside one
    process's (given.value["layers"]) and what the rank computes alone from its layers."""
    return [
        (rank, "output", got, tanh_block(given.value["layers"], x), tanh_block(own, x))
        for rank, (got, (own, x)) in enumerate(zip(results, given.parts))
    ]


def computed_with_peers(found, where, alone, wrong):
    """Judge a case where each rank was given its own part of the layers only, the rest other numbers (a Given):
    each (rank, name, got, expected, by_itself) of found is one process's (expected). Where it is instead what
    that rank computes by itself from all it was given (by_itself), alone = (concept, what it was given, what a
    rank does instead) says so; else wrong (a concept) says how far it is."""
    for rank, name, got, expected, by_itself in found:
        if got is not None and close(got, expected):
            continue
        said_where = f"{where}: rank {rank}'s {name}"
        concept, given, rule = alone
        assert not (got is not None and close(got, by_itself)), said(
            concept, f"{said_where} is what it computes alone from {given}. {rule}"
        )
        sizes = "None" if got is None else "x".join(map(str, got.shape))
        if got is not None and got.shape == expected.shape:
            sizes += f", off by up to {(got - expected).abs().max():.3g}"
        raise AssertionError(
            said(wrong, f"{said_where} is {sizes}, where one process's is {'x'.join(map(str, expected.shape))}")
        )


def describe_ratio(name, got, expected, rank, before="", after="", close=float32_close, whose="gradients"):
    """A sentence about how a gradient differs from the expected one, with its concept (course/grading/points.py);
    before and after are the check's own words around it (a str added to a Said is a plain str again).
    close(a, b): whether two gradients are equal at the precision they were computed in; whose: the
    concept's subject ("the hook's gradients", say)."""
    ratio = ((got * expected).sum() / (expected * expected).sum().clamp_min(1e-30)).item()
    if close(got, expected * ratio) and not close(expected * ratio, expected):
        hint = " did you divide by the world size?" if ratio > 1 else ""
        concept = f"{whose} summed over the ranks, not averaged" if ratio > 1 else f"{whose} scaled down"
        return said(
            concept, f"{before}rank {rank}'s gradient of {name} is {ratio:.1f}x the expected average:{hint}{after}"
        )
    return said(
        f"{whose} not the average over the ranks",
        f"{before}rank {rank}'s gradient of {name} is not the average of the ranks' gradients{after}",
    )


def global_batch(config, step, world_size, g=None):
    """The rows every rank agrees on for one step: world_size * batch_size of them, drawn from g (by default
    seeded with the step)."""
    g = g or torch.Generator().manual_seed(1000 + step)
    rows = world_size * config.batch_size
    return torch.randn(rows, config.d_in, generator=g), torch.randint(0, config.n_classes, (rows,), generator=g)


# SMALL's gradients are 160, 400 and 480 bytes, last layer first: buckets of 600 B hold [160, 400], [480].
SMALL_BUCKET_MB = 600 / 2**20


def wrapper(folder, name):
    """The wrapper of that name: folder's (loaded in a probe), or torch's own DDP (folder None: reference_world())."""
    return {
        "ddp": lambda model: load(folder).mlp.wrap_ddp(model),  # exercise 3's
        "torch_ddp": lambda model: torch.nn.parallel.DistributedDataParallel(model),
        "mydp": lambda model: load(folder).mydp.MyDP(model),
        "overlapped": lambda model: load(folder).mydp.OverlappedDP(model, bucket_cap_mb=0),
        "bucketed": lambda model: load(folder).mydp.OverlappedDP(model, bucket_cap_mb=SMALL_BUCKET_MB),
    }[name]


def parallel_steps(folder, wrap_name, shares):
    """Probe, on every rank: wrap the same model, and train on this rank's share of each step (``shares``: the
    judge gives each rank its own rows only, so no rank knows the batch whose gradient it must average).

    Every rank starts from rank 0's weights: the wrapper's broadcast has a check of its own
    (check_start_sync), so that a wrapper that forgets it loses that check, not this one too."""
    torch.manual_seed(100)
    model = SmallMLP()
    wrapped = wrapper(folder, wrap_name)(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=CONFIG.lr)
    grads, history = None, []
    for step, (x, y) in enumerate(shares):
        optimizer.zero_grad()
        _, loss = wrapped(x, y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"grads": grads, "history": history}


def start_state(folder, wrap_name):
    """Probe: ranks build different weights and buffers; the wrapper must hand every rank rank 0's."""
    model = model_with_buffers(dist.get_rank())
    wrapped = wrapper(folder, wrap_name)(model)
    return {"kept": wrapped.module is model, "state": {k: v.clone() for k, v in model.state_dict().items()}}


# What a wrapper that leaves the ranks apart at the start forgot, by wrapper.
START_ADVICE = {
    "ddp": "DDP hands every rank rank 0's parameters and buffers when it is built, unless it is told not to"
    " (init_sync=False)",
    "mydp": "broadcast parameters and buffers from rank 0",
    "overlapped": "broadcast parameters and buffers from rank 0",
}


def check_start_sync(folder, world_size, wrap_name="mydp"):
    """After wrapping, every rank holds rank 0's parameters and buffers, in the model it was given."""
    expected = model_with_buffers(0).state_dict()
    states = world(
        start_state, world_size, folder, wrap_name, expect={"kept": bool, "state": keyed(torch.Tensor, expected)}
    )
    for rank, got in enumerate(states):
        assert got["kept"] is True, said(
            "the wrapper not keeping the model as .module", "the wrapper should keep the wrapped model as .module"
        )
        for name, value in expected.items():
            assert torch.equal(got["state"][name], value), said(
                "ranks not started from rank 0's parameters and buffers",
                f"after wrapping the model, rank {rank}'s {name} is not rank 0's: {START_ADVICE[wrap_name]}",
            )


def model_with_buffers(seed):
    """A small model with parameters and buffers. Seeded by rank in a probe, the ranks' copies differ
    (its running_mean holds the seed too); model_with_buffers(0) is rank 0's."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    model[1].running_mean.fill_(float(seed))
    return model


def one_process(model, optimizer, batches, world_size):
    """The judge's run: a step of one process on each whole batch of ``batches`` (drawn_batches()'s). Returns
    each rank's own gradients of the first step's batch, before any step, and the parameters after
    each step."""
    local, history = [], []
    for step, (x, y) in enumerate(batches):
        if step == 0:
            for r in range(world_size):
                model.zero_grad()
                mine = slice(r * CONFIG.batch_size, (r + 1) * CONFIG.batch_size)
                model(x[mine], y[mine])[1].backward()
                local.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return local, history


def drawn_batches(world_size, steps, micro_batches=1):
    """Each step's batch, drawn as the check runs where the grade counts (drawn()), each rank given its rows:
    micro_batches * batch_size consecutive ones of each step, in rank order."""
    rows = micro_batches * CONFIG.batch_size

    def mine(batches, rank):
        return [tuple(t[rank * rows : (rank + 1) * rows] for t in batch) for batch in batches]

    return Given(
        lambda: [global_batch(CONFIG, step, world_size * micro_batches, drawn(1000 + step)) for step in range(steps)],
        lambda batches: [(mine(batches, rank),) for rank in range(world_size)],
    )


def check_equivalence(folder, wrap_name, world_size, steps=3, given=None):
    """k parallel steps equal k steps of one process on the concatenated batch, on every rank; what the ranks
    returned (parallel_steps). ``given``: the steps' batches (drawn_batches()), new ones if not given."""
    torch.manual_seed(100)  # rank 0's start
    model = SmallMLP()
    expect = {"grads": parameters_of(model), "history": many(parameters_of(model), steps)}
    given = given or drawn_batches(world_size, steps)
    results = world(parallel_steps, world_size, folder, wrap_name, expect=expect, per_rank=given)
    batches = given.value
    optimizer = torch.optim.SGD(model.parameters(), lr=CONFIG.lr)
    for step, (x, y) in enumerate(batches):
        if step == 0:
            local = []
            for r in range(world_size):
                model.zero_grad()
                mine = slice(r * CONFIG.batch_size, (r + 1) * CONFIG.batch_size)
                model(x[mine], y[mine])[1].backward()
                local.append({n: p.grad.clone() for n, p in model.named_parameters()})
            for rank, result in enumerate(results):
                for name, got in result["grads"].items():
                    expected = sum(g[name] for g in local) / world_size
                    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-6), describe_ratio(
                        name, got, expected, rank
                    )
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()
        for rank, result in enumerate(results):
            for name, p in model.named_parameters():
                got = result["history"][step][name]
                assert torch.equal(got, results[0]["history"][step][name]), said(
                    "ranks' parameters apart after a step",
                    f"after step {step}, rank {rank}'s {name} differs from rank 0's",
                )
                assert torch.allclose(got, p.detach(), rtol=1e-4, atol=1e-5), (
                    f"after step {step}, rank {rank}'s {name} differs from one process trained on the whole batch"
                )
    return results


class PlainSGD:
    """The checks' optimizer where the optimizer is not what is checked: torch.optim.SGD's step without
    momentum, p -= lr * p.grad. torch's first optimizer in a process imports torch._dynamo (1.4 s per rank
    on 2 cores), which every check of the exercise would pay."""

    def __init__(self, params, lr):
        self.params, self.lr = list(params), lr

    def zero_grad(self):
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self):
        for param in self.params:
            if param.grad is not None:
                param.add_(param.grad, alpha=-self.lr)
