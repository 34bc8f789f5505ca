"""Exercise 15: pipeline parallelism, GPipe and 1F1B, from point-to-point messages.

The probes run the student's Pipeline on the tests' own stages (OwnStage: a six-layer MLP cut by
the judge's rule) and record what happens through the tests' own instrumentation, never by asking
the student's code: a forward pre-hook names each forward by the micro-batch its input belongs
to, a hook on each forward's output notes that micro-batch's backward, saved-tensor hooks count
the micro-batches whose activations autograd keeps, and CommLog notes every message. The judge
recomputes the rest: one process on the whole batch, and torch's own pipelining (PipelineStage with
ScheduleGPipe and Schedule1F1B) on the same stages; the textbook orders and cuts of its cases are tables
worked out by hand.
"""

import itertools
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from checks.comm_log import CommLog
from checks.helpers import (
    against_the_judge,
    drawn,
    either,
    forward_from,
    judged,
    load,
    many,
    maybe,
    reference_world,
    validated,
    world,
)
from course.grading.points import said
from course.launch import WorldFailed

WIDTHS = [12, 10, 10, 10, 10, 10, 4]  # six layers: 4 stages hold 2, 2, 1 and 1 of them
HIDDEN = 10  # the width of every activation that travels between stages
ROWS = 24  # a batch: 2, 4, 6 or 8 micro-batches of equal size
LR = 0.2
# (p stages, [m micro-batches, ...]): (3, 2) has fewer micro-batches than stages, (4, 2) fewer than the
# warm-up of stage 0 would run without its cap at m. One world call per p.
ORDER_CASES = [(2, [4]), (3, [6, 2]), (4, [8, 2])]
NAMES = {"gpipe": "GPipe", "1f1b": "1F1B"}
FUNCTIONS = {"gpipe": "gpipe", "1f1b": "one_f_one_b"}  # the student's function of each schedule


# The judge's cuts of n layers into p stages, worked out by hand from the rule (p runs of consecutive layers, as
# even as possible, the first ones longer): the length of each run. This file, which students have, holds
# answers for its own cases only, no maker of them; where the grade counts, cases drawn as it grades are
# judged by the reference solutions (judged_schedules, check_stage_layers).
CUTS = {
    (6, 1): [6],
    (6, 2): [3, 3],
    (6, 3): [2, 2, 2],
    (6, 4): [2, 2, 1, 1],
    (7, 3): [3, 2, 2],
    (4, 4): [1, 1, 1, 1],
    (5, 1): [5],
    (9, 4): [3, 2, 2, 2],
}


def layers_by_rule(n_layers, p):
    """The judge's cut of a case of CUTS: each stage's layers."""
    ends = list(itertools.accumulate(CUTS[(n_layers, p)], initial=0))
    return [list(range(a, b)) for a, b in zip(ends, ends[1:])]


def initial_weights():
    g = torch.Generator().manual_seed(15)
    return [torch.randn(b, a, generator=g) / a**0.5 for a, b in zip(WIDTHS, WIDTHS[1:])]


def batch(step):
    g = torch.Generator().manual_seed(150 + step)
    return torch.randn(ROWS, WIDTHS[0], generator=g), torch.randint(0, WIDTHS[-1], (ROWS,), generator=g)


class OwnStage(nn.Module):
    """Layers `layers` of the tests' MLP, with tanh after each but the model's last."""

    def __init__(self, weights, layers):
        super().__init__()
        self.first = layers[0]
        self.ends_model = layers[-1] == len(weights) - 1
        self.weights = nn.ParameterList(nn.Parameter(weights[k].clone()) for k in layers)

    def forward(self, x):
        for k, weight in enumerate(self.weights):
            x = x @ weight.T
            if not (self.ends_model and k == len(self.weights) - 1):
                x = torch.tanh(x)
        return x


def stage_of(p, rank):
    weights, layers = initial_weights(), layers_by_rule(len(WIDTHS) - 1, p)[rank]
    return OwnStage(weights, layers), weights, layers


# --- the instrumentation: what a probe records, whatever the student's code does -------------------


class NoGradientBack(RuntimeError):
    """Raised by the tests' hook, in the student's forward: a stage's received input asks for no gradient."""


class Saved:
    """A tensor that autograd keeps for a backward, counted for its micro-batch while it lives."""

    def __init__(self, tensor, label, recorder):
        self.tensor, self.label, self.recorder = tensor, label, recorder
        recorder.live[label] = recorder.live.get(label, 0) + 1
        recorder.peak = max(recorder.peak, sum(1 for n in recorder.live.values() if n))

    def __del__(self):
        self.recorder.live[self.label] -= 1


class Recorder:
    """On one rank: each forward and backward of the stage, by micro-batch, and the most micro-batches
    whose activations autograd kept at once. `with recorder:` around the student's run."""

    def __init__(self, stage, expected_inputs):
        self.events, self.live, self.peak, self.current = [], {}, 0, None
        self.expected = expected_inputs  # what the stage's forward i receives
        self.seen = []  # (micro-batch, a weak reference to its forward's input or output)
        stage.register_forward_pre_hook(self._forward_starts)
        stage.register_forward_hook(self._forward_ends)

    def _which(self, x):
        found = [i for i, e in enumerate(self.expected) if x.shape == e.shape and torch.allclose(x, e, atol=1e-5)]
        return found[0] if found else "?"

    def _forward_starts(self, stage, args):
        (x,) = args
        self.current = self._which(x.detach())
        self.events.append(("F", self.current))
        self.seen.append((self.current, weakref.ref(x)))
        if stage.first > 0 and not x.requires_grad:
            raise NoGradientBack(f"stage input of micro-batch {self.current} asks for no gradient")

    def _forward_ends(self, stage, args, output):
        label = self.current
        self.seen.append((label, weakref.ref(output)))
        if output.requires_grad:
            output.register_hook(lambda grad: self.events.append(("B", label)))

    def still_held(self):
        """The micro-batches whose forward's input or output someone still holds."""
        return sorted({label for label, ref in self.seen if ref() is not None}, key=str)

    def __enter__(self):
        pack = lambda tensor: Saved(tensor, self.current, self)  # noqa: E731
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved.tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


# The textbook orders of the checks' cases, worked out by hand from the handout's rules. GPipe: every forward,
# then every backward in reverse order, the same on every stage (by m). 1F1B: a forward whenever one is left and
# the stage holds fewer than p - s micro-batches, else a backward (by (p, m), one per stage).
GPIPE = {
    2: "F0 F1 B1 B0",
    3: "F0 F1 F2 B2 B1 B0",
    4: "F0 F1 F2 F3 B3 B2 B1 B0",
    6: "F0 F1 F2 F3 F4 F5 B5 B4 B3 B2 B1 B0",
    8: "F0 F1 F2 F3 F4 F5 F6 F7 B7 B6 B5 B4 B3 B2 B1 B0",
}
ONE_F_ONE_B = {
    (1, 3): ["F0 B0 F1 B1 F2 B2"],
    (2, 4): ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"],
    (3, 2): ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"],
    (3, 6): [
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
    ],
    (4, 2): ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"],
    (4, 8): [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    ],
}


def textbook(schedule, p, m, s):
    """The judge's order of stage s, for a case of GPIPE or ONE_F_ONE_B."""
    text = GPIPE[m] if schedule == "gpipe" else ONE_F_ONE_B[(p, m)][s]
    return [(event[0], int(event[1:])) for event in text.split()]


def spelled(events):
    """Events as the handout writes them: F0 F1 B0."""
    return " ".join("".join(map(str, e)) for e in events)


def typed(schedule):
    """What a schedule is, in words: "list of tuple" for a list of tuples (read before anything else reads it)."""
    inner = sorted({type(e).__name__ for e in schedule}) if isinstance(schedule, (list, tuple)) else []
    return f"{type(schedule).__name__} of {' and '.join(inner) or 'nothing'}"


def as_events(schedule):
    """A schedule as plain data, a list of tuples, the first time it is read; None if it is no list of events."""
    try:
        return [tuple(e) for e in schedule]
    except TypeError:
        return None


def schedule_problem(schedule, p, m, made, again):
    """What keeps the stages' schedules, made[s] as the student's function returned it for stage s (again[s]:
    read a second time), from running: (concept, sentence), or None. Each must be the same list whenever it is
    read, one forward and one backward per micro-batch, each backward after its forward, in orders that never
    leave the stages waiting for each other. Called in the probe, which then runs no pipeline that would hang or
    fail, and in the judge, which says it."""
    call = lambda s: f"{FUNCTIONS[schedule]}({m}, {p}, {s}) returned {spelled(made[s]) or 'no events'}"  # noqa: E731
    for s in range(p):
        if made[s] is None:
            return (
                "a schedule that is not a list of events",
                f"{FUNCTIONS[schedule]}({m}, {p}, {s}) returned no list of events: a schedule is a list of"
                ' ("F", i) and ("B", i)',
            )
        if again[s] != made[s]:
            return (
                "a schedule that runs once only",
                f"{call(s)} when read once, and {spelled(again[s]) or 'no events'} when read again: Pipeline.run"
                " reads the same events at every step, so a schedule is a list (a generator is empty once read)",
            )
    for s in range(p):
        wrong = next(
            (
                e
                for e in made[s]
                if len(e) != 2 or e[0] not in ("F", "B") or not isinstance(e[1], int) or e[1] not in range(m)
            ),
            None,
        )
        if wrong is not None:
            return (
                "an event on no micro-batch",
                f"{call(s)}: {spelled([wrong])} is no micro-batch's forward or backward; there are m = {m}"
                f" micro-batches, 0 to {m - 1}, and a stage cannot run more forwards than that",
            )
        if sorted(made[s]) != sorted((k, i) for k in "FB" for i in range(m)):
            return (
                "not one forward and one backward per micro-batch",
                f"{call(s)}: each of the {m} micro-batches needs one forward and one backward on every stage",
            )
        early = next((i for k, i in made[s] if k == "B" and made[s].index(("B", i)) < made[s].index(("F", i))), None)
        if early is not None:
            return (
                "a backward before its forward",
                f"{call(s)}: B{early} comes before F{early}; a micro-batch's backward runs from what its forward kept",
            )
    # Run the orders together: an event waits for its message, F i for F i of the stage before, B i for B i of
    # the stage after.
    done, at = [set() for _ in range(p)], [0] * p
    while True:
        ready = [
            s
            for s in range(p)
            if at[s] < 2 * m
            and (
                (made[s][at[s]][0] == "F" and (s == 0 or made[s][at[s]] in done[s - 1]))
                or (made[s][at[s]][0] == "B" and (s == p - 1 or made[s][at[s]] in done[s + 1]))
            )
        ]
        if not ready:
            break
        for s in ready:
            done[s].add(made[s][at[s]])
            at[s] += 1
    stuck = [s for s in range(p) if at[s] < 2 * m]
    if not stuck:
        return None
    waits = []
    for s in stuck:
        kind, i = made[s][at[s]]
        peer = s - 1 if kind == "F" else s + 1
        waits.append(
            f"stage {s} waits at {kind}{i} for {kind}{i} of stage {peer}, which comes after its {spelled([made[peer][at[peer]]])}"
        )
    warmups = ""
    if schedule == "1f1b":
        counts = ", ".join(f"stage {s}: {made[s].index(next(e for e in made[s] if e[0] == 'B'))}" for s in range(p))
        warmups = (
            f"; forwards before the first backward, by stage: {counts} (which stage can start its backwards first?)"
        )
    return (
        "schedules that wait for each other forever",
        f"{NAMES[schedule]} with p={p} stages and m={m} micro-batches: the stages' orders can never finish,"
        f" {'; '.join(waits)}. {'; '.join(call(s) for s in range(p))}{warmups}",
    )


# --- the probes ------------------------------------------------------------------------------------


def pipelines(folder, runs):
    """Probe: each of `runs`, (schedule, m, steps, events_from), through pipeline_steps; what each recorded.
    Several runs in one call read the student's files once (about 50 ms a call on 4 ranks)."""
    pp = load(folder).pp
    return [pipeline_steps(pp, *one) for one in runs]


def pipeline_steps(pp, schedule, m, steps, events_from):
    """`steps` steps of SGD on this rank's OwnStage through the student's Pipeline, with the student's
    events of `schedule` ("student") or the textbook's ("textbook"); the first step recorded."""
    rank, p = dist.get_rank(), dist.get_world_size()
    stage, weights, layers = stage_of(p, rank)
    x0 = batch(0)[0]
    for k in range(layers[0]):  # what this stage receives: the layers before it, applied
        x0 = torch.tanh(x0 @ weights[k].T)
    recorder = Recorder(stage, list(x0.tensor_split(m)))
    out = {"losses": [], "history": []}
    if events_from == "student":
        # Every stage's schedule, judged as lists before any runs: a schedule that would hang or fail is
        # said as the schedule it is (every rank finds the same, and none runs).
        made = [getattr(pp, FUNCTIONS[schedule])(m, p, s) for s in range(p)]
        out["types"] = [typed(events) for events in made]
        out["schedules"] = [as_events(events) for events in made]
        out["again"] = [as_events(events) for events in made]
        if schedule_problem(schedule, p, m, out["schedules"], out["again"]):
            return out
        events = made[rank]
    else:
        events = textbook(schedule, p, m, rank)
    optimizer = torch.optim.SGD(stage.parameters(), lr=LR)
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        with CommLog() as log, recorder:
            pipeline = pp.Pipeline(stage, m, (ROWS // m, HIDDEN))
            loss = pipeline.run(events, x if rank == 0 else None, y if rank == p - 1 else None)
        if step == 0:
            out["returned"] = type(loss).__name__
            out["messages"] = [(e.what, e.peer, e.nbytes) for e in log.started()]
            out["events"] = [list(e) for e in recorder.events]
            out["peak"] = recorder.peak
            out["held"] = recorder.still_held()  # while the pipeline that ran the step lives
            out["grads"] = [None if w.grad is None else w.grad.clone() for w in stage.weights]
        out["losses"].append(None if loss is None else float(loss))
        optimizer.step()
        out["history"].append([w.detach().clone() for w in stage.weights])
    return out


def recorded(steps):
    """What pipeline_steps returns for `steps` steps."""
    return {
        "losses": many(maybe(float), steps),
        "returned": str,
        "history": many(many(torch.Tensor), steps),
        "messages": many((str, object, int)),
        "events": many(many(object)),
        "peak": int,
        "grads": many(maybe(torch.Tensor)),
        "held": many(object),
    }


def torch_pipeline(schedule, m):
    """Probe, no student code: one step of torch's pipelining on the stages and batch of pipeline_steps; this
    stage's gradients."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, p = dist.get_rank(), dist.get_world_size()
    stage = stage_of(p, rank)[0]
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    runner = kind(PipelineStage(stage, rank, p, torch.device("cpu")), n_microbatches=m, loss_fn=F.cross_entropy)
    x, y = batch(0)
    if rank == 0:
        runner.step(x)
    elif rank == p - 1:
        runner.step(target=y)
    else:
        runner.step()
    return [w.grad.clone() for w in stage.weights]


def on_pipeline(fn, p, *args, expect):
    """Stages pass gradients back through what they received and keep the graph for the backward. Runs the
    probe on p ranks, its results checked against expect (a message no peer answers fails after the checks'
    collective timeout, COURSE_COLLECTIVE_TIMEOUT, so a hang is reported at once); a failure that shows a known
    mistake is said as that mistake, any other as the launcher reports it."""
    try:
        return world(fn, p, *args, expect=expect)
    except WorldFailed as failed:
        first = failed.failure.fact(failed.failure.first) if failed.failure.first is not None else None
        if first is None:
            raise
        assert first.error != NoGradientBack.__name__, said(
            "a received activation that asks for no gradient",
            f"stage {first.rank} ran its forward on a received activation that asks for no gradient: its"
            f" backward then computes no gradient to send back to stage {first.rank - 1} (requires_grad_()"
            " on what arrives, before the forward)",
        )
        # torch's batch_isend_irecv reads its list's first operation before anything else
        assert not (first.error == "IndexError" and "batch_isend_irecv" in first.traceback), said(
            "batch_isend_irecv given an empty list",
            f"stage {first.rank} called dist.batch_isend_irecv with no message to send or receive ({first.where()}):"
            " it refuses an empty list, and some events have nothing to send or receive (the first stage's first"
            " forward, the last event of a step)",
        )
        # torch's words for a backward from a tensor that has no graph
        assert "does not require grad and does not have a grad_fn" not in first.message, said(
            "the backward started from a detached output",
            f"stage {first.rank}'s backward started from a tensor with no graph ({first.where()}): keep the"
            " output the forward computed for the backward (a detached copy is for sending, not for keeping)",
        )
        raise


def one_process(steps):
    """The judge's run: the whole MLP in one process, SGD on each step's whole batch. Its loss and
    gradients of the first step, and the weights after each step."""
    weights = [w.clone().requires_grad_() for w in initial_weights()]
    optimizer = torch.optim.SGD(weights, lr=LR)
    losses, history, grads = [], [], None
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        loss = F.cross_entropy(forward_from(weights, x), y)
        loss.backward()
        if step == 0:
            grads = [w.grad.clone() for w in weights]
        losses.append(float(loss.detach()))
        optimizer.step()
        history.append([w.detach().clone() for w in weights])
    return losses, grads, history


def close(got, expected):
    return torch.allclose(got, expected, rtol=1e-4, atol=1e-6)


# --- the checks ------------------------------------------------------------------------------------

LAYER_CASES = [(6, 4), (6, 2), (7, 3), (4, 4), (5, 1), (9, 4)]  # each in CUTS


def stage_cuts(folder, cases):
    """Probe: stage_layers on every case, (n, p), as lists, and the type of what it returned and of each run (a
    pure function: rank 0's answer is enough)."""
    pp = load(folder).pp
    found = []
    for n, p in cases:
        stages = pp.stage_layers(n, p)
        found.append([type(stages).__name__, [type(r).__name__ for r in stages], [list(r) for r in stages]])
    return found


def check_stage_layers(folder):
    """stage_layers cuts the layers into p consecutive runs, in order, as even as possible, the longer first."""
    cases = many((str, many(str), many(many(int))), len(LAYER_CASES))
    got = on_pipeline(stage_cuts, 2, folder, LAYER_CASES, expect=cases)[0]  # the world of 2 that the order check keeps
    for (n, p), (kind, kinds, mine) in zip(LAYER_CASES, got):
        odd = next((k for k in kinds if k != "range"), None)
        assert kind == "list" and odd is None, said(
            "stage_layers not a list of ranges",
            f"stage_layers({n}, {p}) returned a {kind} of {odd or 'range'}s: it returns a list of ranges, one per"
            " stage (Stage reads the range's .stop, pipeline_of indexes the list)",
        )
        where = f"stage_layers({n}, {p}) returned {[f'range({r[0]}, {r[-1] + 1})' if r else 'range(0)' for r in mine]}"
        held = [k for layers in mine for k in layers]
        twice = sorted({k for k in held if held.count(k) > 1})
        assert not twice, said(
            "stages that overlap", f"{where}: layer {twice[0]} is in two stages: the stages must not overlap"
        )
        assert len(mine) == p, said(
            "not one run of layers per stage", f"{where}: one run of layers per stage, {p} of them"
        )
        assert sorted(held) == list(range(n)), said(
            "a layer in no stage", f"{where}: every layer, 0 to {n - 1}, belongs to a stage"
        )
        assert held == list(range(n)), said(
            "stages not consecutive runs in order",
            f"{where}: stage s holds the s-th run of consecutive layers, in order",
        )
        expected = layers_by_rule(n, p)
        assert mine == expected, said(
            "runs not as even as possible, the longer first",
            f"{where}: the runs as even as possible, the first {n} % {p} = {n % p} of them one layer longer",
        )
    if judged():
        g = drawn(16)
        drawn_cases = []
        for _ in range(6):
            n = int(torch.randint(1, 41, (1,), generator=g))
            drawn_cases.append((n, int(torch.randint(1, n + 1, (1,), generator=g))))
        shape = many((str, many(str), many(many(int))), len(drawn_cases))
        (got,) = world(stage_cuts, 1, folder, drawn_cases, expect=shape)
        against_the_judge(
            got,
            stage_cuts,
            drawn_cases,
            expect=shape,
            what=lambda k: "stage_layers({}, {}), as lists,".format(*drawn_cases[k]),
            same=lambda mine, reference: mine[2] == reference[2],
            shown=lambda found: str(found[2]),
        )


def made(p):
    """What pipeline_steps returns when the student's schedules cannot run: every stage's schedule, read twice."""
    return {
        "schedules": many(maybe(many(object)), p),
        "again": many(maybe(many(object)), p),
        "types": many(str, p),
    }


def refuse_schedules(schedule, p, m, got):
    """A run on the student's schedules that the probe did not run (schedule_problem) fails as the schedule's
    mistake, before its numbers are read."""
    problem = schedule_problem(schedule, p, m, got["schedules"], got["again"])
    assert problem is None, said(*problem)


def schedule_answers(folder, schedule, cases):
    """Probe: the schedule's events for each case (m, p, s), as plain data (None: no list of events)."""
    pp = load(folder).pp
    return [as_events(getattr(pp, FUNCTIONS[schedule])(m, p, s)) for m, p, s in cases]


def judged_schedules(folder, schedule):
    """Where the grade counts, the student's schedule on cases drawn as it grades equals the reference's: a
    schedule that looks up the tables above is right on the checks' own cases only."""
    g = drawn(15)
    cases = []
    # GPipe's order depends on m alone: among many m, the tables' five are few.
    for _ in range(8):
        m, p = int(torch.randint(1, 33, (1,), generator=g)), int(torch.randint(2, 9, (1,), generator=g))
        cases.append((m, p, int(torch.randint(0, p, (1,), generator=g))))
    shape = many(maybe(many(object)), len(cases))
    (got,) = world(schedule_answers, 1, folder, schedule, cases, expect=shape)
    against_the_judge(
        got,
        schedule_answers,
        schedule,
        cases,
        expect=shape,
        what=lambda k: "{}({}, {}, {})".format(FUNCTIONS[schedule], *cases[k]),
        shown=lambda events: spelled(events) if events else "no events",
    )


def runs_on(p, folder, runs):
    """The student's pipelines on p ranks: for each of `runs`, what each stage recorded."""
    if judged():
        for schedule in sorted({schedule for schedule, _, _, events_from in runs if events_from == "student"}):
            judged_schedules(folder, schedule)
    whole = tuple(recorded(steps) for _, _, steps, _ in runs)
    first = tuple(either(made(p), whole[k]) if run[3] == "student" else whole[k] for k, run in enumerate(runs))
    by_rank = on_pipeline(pipelines, p, folder, runs, expect=first)
    for k, (schedule, m, _, events_from) in enumerate(runs):
        if events_from == "student":
            refuse_schedules(schedule, p, m, by_rank[0][k])
    validated(by_rank, whole, p)
    return [[mine[k] for mine in by_rank] for k in range(len(runs))]


def check_order(folder, schedule):
    """On every stage, the schedule's list, and the forwards and backwards that the tests' hooks saw, come in
    the textbook's order."""
    for p, ms in ORDER_CASES:
        for m, stages in zip(ms, runs_on(p, folder, [(schedule, m, 1, "student") for m in ms])):
            for s, got in enumerate(stages):
                call = f"{FUNCTIONS[schedule]}({m}, {p}, {s}) returned"
                assert got["types"][s] == "list of tuple", said(
                    "a schedule not a list of tuples",
                    f"{call} a {got['types'][s]}: a schedule is a list of tuples, ('F', i) and ('B', i), as the"
                    " TODO's example compares it with ==",
                )
                judge_order(schedule, p, m, s, got["schedules"][s], call)
                judge_order(schedule, p, m, s, [tuple(e) for e in got["events"]], f"stage {s} ran")


def judge_order(schedule, p, m, s, events, did):
    """Stage s runs its forwards and backwards in the schedule's textbook order; did: who gave the events."""
    name, expected = NAMES[schedule], textbook(schedule, p, m, s)
    forwards = [i for kind, i in events if kind == "F"]
    backwards = [i for kind, i in events if kind == "B"]
    where = f"{name} with p={p} stages and m={m} micro-batches: {did} {spelled(events)}"
    assert "?" not in forwards, said(
        "a forward on no micro-batch's activation",
        f"{where}: a forward's input was no micro-batch's activation (F?): forward i runs on micro-batch i's"
        " activation, received from the stage before",
    )
    assert sorted(forwards) == list(range(m)) == sorted(backwards), said(
        "not one forward and one backward per micro-batch",
        f"{where}: each micro-batch needs one forward and one backward on every stage",
    )
    assert forwards == list(range(m)), said(
        "forwards out of micro-batch order", f"{where}: the forwards run in micro-batch order"
    )
    if schedule == "gpipe":
        assert not (m > 1 and backwards == list(range(m))), said(
            "GPipe's backwards in forward order",
            f"{where}: the backwards ran in forward order; GPipe's run in reverse order, micro-batch {m - 1} first"
            " (the handout's order; torch's ScheduleGPipe runs them in forward order)",
        )
    else:
        before, wanted = events.index(("B", backwards[0])), min(p - s, m)
        few = (
            "its first backward waits for micro-batch 0 to come back from the stages after it while this"
            " stage could run the next forward"
        )
        many = f"the stage holds {before} micro-batches' activations at once where 1F1B needs {wanted}"
        assert before == wanted, said(
            "1F1B's warm-up forwards miscounted",
            f"{where}: {before} forward{'s' if before != 1 else ''} before the first backward, where 1F1B's stage {s} of {p} runs {wanted}:"
            f" {abs(before - wanted)} warm-up forward{'s' if abs(before - wanted) > 1 else ''} too"
            f" {'few' if before < wanted else 'many'}; {few if before < wanted else many}",
        )
    assert events == expected, said(
        f"the {name} order of forwards and backwards",
        f"{where}; {name} runs {spelled(expected)}",
    )


MEMORY_CASE = (3, [6, 2])  # p = 3 stages; with 2 micro-batches, fewer than stages


def check_memory(folder, schedule):
    """The micro-batches whose activations autograd holds at once: m under GPipe, at most p - s under 1F1B;
    none of their inputs and outputs after the step."""
    p, ms = MEMORY_CASE
    for m, stages in zip(ms, runs_on(p, folder, [(schedule, m, 1, "student") for m in ms])):
        for s, got in enumerate(stages):
            where = f"{NAMES[schedule]} with p={p} stages and m={m} micro-batches: stage {s} held"
            if schedule == "gpipe":
                assert got["peak"] == m, said(
                    "GPipe not keeping every micro-batch's activations until the backwards",
                    f"{where} the activations of {got['peak']} micro-batches at once: GPipe keeps all {m} until"
                    " the backwards",
                )
            else:
                assert got["peak"] <= min(p - s, m), said(
                    "1F1B holding more than p - s micro-batches' activations",
                    f"{where} the activations of {got['peak']} micro-batches at once, 1F1B at most p - s ="
                    f" {p - s}: run each backward as soon as the stages after allow, and let it free what its"
                    " forward kept (no retain_graph)",
                )
            assert not got["held"], said(
                "micro-batches kept after their backward",
                f"{where} the inputs or outputs of micro-batches {got['held']} still after the step, whose backwards"
                " had run: backward(i) forgets micro-batch i (nothing of it is kept after it), or the stage keeps"
                " every micro-batch's input and output until the step ends",
            )


def describe_gradient(where, s, k, got, expected, m, whose="one process's on the whole batch"):
    """A sentence about how a stage's gradient of layer k differs from the expected one, after `where`, with
    its concept."""
    ratio = ((got * expected).sum() / (expected * expected).sum()).item()
    if close(got, expected * ratio) and abs(ratio - m) < 1e-3 * m:
        return said(
            "micro-batch losses not scaled by 1/m",
            f"{where}: stage {s}'s gradient of layer {k} is {ratio:.1f}x {whose}, m = {m}: scale each"
            " micro-batch's loss by 1/m, so that the m backwards add up to the batch's mean",
        )
    if close(got, expected * ratio) and abs(ratio - 1) > 1e-3:
        return said("a stage's gradients scaled", f"{where}: stage {s}'s gradient of layer {k} is {ratio:.2f}x {whose}")
    return said("a stage's gradients wrong", f"{where}: stage {s}'s gradient of layer {k} differs from {whose}")


def check_gradients(folder, schedule):
    """After one step on the textbook's order, every stage's gradients and the loss equal one process's."""
    p, m = 4, 8
    losses, grads, _ = one_process(1)
    (stages,) = runs_on(p, folder, [(schedule, m, 1, "textbook")])
    where = f"{NAMES[schedule]} with p={p} stages and m={m} micro-batches"
    for s, got in enumerate(stages):
        for k, g in zip(layers_by_rule(len(WIDTHS) - 1, p)[s], got["grads"]):
            assert g is not None, said(
                "a stage's layer without a gradient",
                f"{where}: stage {s}'s layer {k} got no gradient: its backward must run through the stage",
            )
            assert close(g, grads[k]), describe_gradient(where, s, k, g, grads[k], m)
    returned = stages[-1]["returned"]
    assert returned == "float", said(
        "Pipeline.run's loss not a float",
        f"{where}: Pipeline.run returned a {returned} on the last stage; it returns the batch's loss as a float, a"
        " number (forward adds each micro-batch's loss to self.loss as one)",
    )
    loss = stages[-1]["losses"][0]
    assert loss is not None and abs(loss - losses[0]) < 1e-5, said(
        "the last stage's loss not one process's on the whole batch",
        f"{where}: run returned the loss {loss} on the last stage, one process's on the whole batch is"
        f" {losses[0]:.6f}: the sum of the micro-batches' scaled losses",
    )
    for s, got in enumerate(stages[:-1]):
        assert got["losses"][0] is None, said(
            "a loss returned before the last stage",
            f"{where}: run returned {got['losses'][0]} on stage {s}, None before the last",
        )


def check_training(folder, steps=3):
    """Three steps of SGD through the student's 1F1B train as one process on the whole batches; so do two steps of
    each schedule on a pipeline of one stage, the first stage and the last at once."""
    p, m = 3, 6
    _, _, expected = one_process(steps)
    (stages,) = runs_on(p, folder, [("1f1b", m, steps, "student")])
    for step in range(steps):
        for s, got in enumerate(stages):
            for k, w in zip(layers_by_rule(len(WIDTHS) - 1, p)[s], got["history"][step]):
                assert close(w, expected[step][k]), (
                    f"after step {step} of 1F1B with p={p} stages and m={m} micro-batches, stage {s}'s layer {k}"
                    " differs from one process trained on the whole batches"
                )
    m, steps = 3, 2
    try:
        alone = runs_on(1, folder, [(schedule, m, steps, "student") for schedule in NAMES])
    except WorldFailed as failed:
        raise AssertionError(
            said(
                "a pipeline of one stage fails",
                f"a pipeline of one stage (p=1, m={m}) failed: {failed.failure.sentence()} Stage 0 is then the first"
                " stage and the last at once: it reads x, computes the loss, and sends and receives nothing",
            )
        ) from None
    for schedule, (got,) in zip(NAMES, alone):
        judge_order(schedule, 1, m, 0, got["schedules"][0], f"{FUNCTIONS[schedule]}({m}, 1, 0) returned")
        judge_order(schedule, 1, m, 0, [tuple(e) for e in got["events"]], "stage 0 ran")
        for step in range(steps):
            for k, w in enumerate(got["history"][step]):
                assert close(w, expected[step][k]), said(
                    "a pipeline of one stage not one process",
                    f"after step {step} of {NAMES[schedule]} with p=1 stage and m={m} micro-batches, layer {k} differs"
                    " from one process trained on the whole batches: stage 0 is the first stage and the last at once",
                )


def exchanges(folder):
    """Probe: communicate with two sends and two receives on every rank, around the ring both ways: each rank's
    own numbers to the next rank and to the one before; what arrived from the rank before and from the next."""
    pp = load(folder).pp
    rank, p = dist.get_rank(), dist.get_world_size()
    after, before = torch.full((2,), -1.0), torch.full((2,), -1.0)
    pp.communicate(
        [(torch.full((2,), 10.0 * rank + 1), (rank + 1) % p), (torch.full((2,), 10.0 * rank + 2), (rank - 1) % p)],
        [(before, (rank - 1) % p), (after, (rank + 1) % p)],
    )
    return [before, after]


def check_communicate(folder, p):
    """communicate starts every send and every receive of its lists, not only the first."""
    for rank, (before, after) in enumerate(world(exchanges, p, folder, expect=many(torch.Tensor, 2))):
        expected = (torch.full((2,), 10.0 * ((rank - 1) % p) + 1), torch.full((2,), 10.0 * ((rank + 1) % p) + 2))
        for got, want, peer in zip((before, after), expected, ((rank - 1) % p, (rank + 1) % p)):
            assert torch.equal(got, want), said(
                "communicate not every send and receive of its lists",
                f"communicate(sends, receives) with two sends and two receives on every rank of {p}, around the ring"
                f" both ways: rank {rank} received {got.tolist()} from rank {peer}, which sent {want.tolist()}: it"
                " starts every send and every receive of the lists, then waits for all",
            )


def check_messages(folder):
    """One message per micro-batch each way between neighbours, each one micro-batch's activation or gradient;
    communicate starts every message of its lists."""
    p, m = 3, 6
    nbytes = ROWS // m * HIDDEN * 4
    (stages,) = runs_on(p, folder, [("1f1b", m, 1, "student")])
    for s, got in enumerate(stages):
        where = f"in one step of 1F1B with p={p} stages and m={m} micro-batches, stage {s}"
        collectives = [what for what, _, _ in got["messages"] if what not in ("send", "recv")]
        assert not collectives, said(
            "collectives in a pipeline, not point-to-point messages",
            f"{where} called {collectives[0]}: a pipeline sends point-to-point messages only",
        )
        for what, peer, size in got["messages"]:
            assert size == nbytes, said(
                "a message not one micro-batch's activation or gradient",
                f"{where} started a {what} of {size} bytes {'to' if what == 'send' else 'from'} rank {peer}: every"
                f" message is one micro-batch's activation or gradient, {ROWS // m}x{HIDDEN} float32 ({nbytes} bytes)",
            )
        expected = {(what, peer): m for what in ("send", "recv") for peer in (s - 1, s + 1) if 0 <= peer < p}
        for what, peer in sorted(expected.keys() | {e[:2] for e in got["messages"]}):
            count = sum(1 for e in got["messages"] if e[:2] == (what, peer))
            assert count == expected.get((what, peer), 0), said(
                "not one message per micro-batch each way between neighbours",
                f"{where} started {count} {what}s {'to' if what == 'send' else 'from'} rank {peer}, a pipeline"
                f" {expected.get((what, peer), 0)}: one each way per micro-batch between neighbours, and no message"
                " for shapes (they are agreed in advance)",
            )
    check_communicate(folder, p)


def check_matches_torch(folder, schedule):
    """torch's PipelineStage with ScheduleGPipe or Schedule1F1B gives each stage the same gradients."""
    p, m = 3, 6
    where = f"{NAMES[schedule]} with p={p} stages and m={m} micro-batches"
    whose = f"torch's PipelineStage with Schedule{NAMES[schedule]}'s on the same stages"
    (stages,) = runs_on(p, folder, [(schedule, m, 1, "student")])
    theirs = reference_world(torch_pipeline, p, schedule, m, expect=many(torch.Tensor))
    for s, (got, expected) in enumerate(zip(stages, theirs)):
        for k, g, t in zip(layers_by_rule(len(WIDTHS) - 1, p)[s], got["grads"], expected):
            assert g is not None, f"{where}: stage {s}'s layer {k} got no gradient, its {whose.replace('s on', ' on')}"
            assert close(g, t), describe_gradient(where, s, k, g, t, m, whose)


@pytest.mark.points(2)
def test_stage_layers(impl_dir):
    check_stage_layers(impl_dir)


def by_schedule(gpipe: int, one_f_one_b: int):
    """A check's two cases, GPipe and 1F1B, with their points."""
    return pytest.mark.parametrize(
        "schedule",
        [
            pytest.param("gpipe", marks=pytest.mark.points(gpipe)),
            pytest.param("1f1b", marks=pytest.mark.points(one_f_one_b)),
        ],
    )


@by_schedule(3, 4)
def test_order(impl_dir, schedule):
    check_order(impl_dir, schedule)


@by_schedule(2, 3)
def test_memory(impl_dir, schedule):
    check_memory(impl_dir, schedule)


@by_schedule(3, 3)
def test_gradients(impl_dir, schedule):
    check_gradients(impl_dir, schedule)


@pytest.mark.points(2)
def test_training(impl_dir):
    check_training(impl_dir)


@pytest.mark.points(3)
def test_messages(impl_dir):
    check_messages(impl_dir)


@by_schedule(2, 3)
def test_matches_torch(impl_dir, schedule):
    check_matches_torch(impl_dir, schedule)
