"""One training step, drawn: when each gradient became ready, when each all-reduce ran, when the optimizer stepped.

`python mydp.py --world-size 2 --timeline step.svg` records one step of MyDP and one of
OverlappedDP on every rank and draws them one above the other: a lane for computation and a lane
for communication per rank, so that overlap is something to see (exercise 6's handout shows it).
`python pp.py --world-size 4 --timeline pp.svg` draws one lane per pipeline stage instead: each
micro-batch's forward and backward (``Spans``), and between them the stage's idle time.

The events come from the step itself, with nothing added to the code under test: the recorder's own
gradient hooks, registered before the wrapper's so that they run first (a gradient is computed), the
process group's all_reduce (started) and the future of its work (ended), and timestamps around
forward, backward and the optimizer step.
"""

from __future__ import annotations

import html
import time

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


class Recorder:
    """Made before the model is wrapped; `with recorder:` then notes what happens, in seconds from
    the start of the block."""

    def __init__(self, model: torch.nn.Module):
        self.events: list = []
        self.active = False
        self._saved = None
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.register_hook(lambda grad, name=name: self._computed(name))

    def _computed(self, name: str) -> None:
        if self.active:
            self.span("grad", self.now(), self.now(), name)

    def now(self) -> float:
        return time.perf_counter() - self.start

    def span(self, kind: str, start: float, end: float, label: str = "") -> None:
        self.events.append({"kind": kind, "start": start, "end": end, "label": label})

    def __enter__(self):
        self.start, self.active = time.perf_counter(), True
        self._saved = vars(ProcessGroup)["allreduce"]
        original = self._saved

        def allreduce(group, *args, **kwargs):
            event = {"kind": "allreduce", "start": self.now(), "end": None, "label": ""}
            tensors = args[0] if args and isinstance(args[0], (list, tuple)) else []
            event["label"] = f"{sum(t.numel() * t.element_size() for t in tensors) / 2**10:.0f} KiB"
            self.events.append(event)
            work = original(group, *args, **kwargs)
            # It has ended when gloo's own thread completes its future, or when a wait for it
            # returns, whichever is noted first (the future's callbacks may run after the waiter wakes).
            work.get_future().add_done_callback(lambda _: self._ended(event))
            return _Waited(work, lambda: self._ended(event))

        ProcessGroup.allreduce = allreduce
        return self

    def _ended(self, event: dict) -> None:
        if event["end"] is None:
            event["end"] = self.now()

    def __exit__(self, *exc):
        ProcessGroup.allreduce = self._saved
        self.active = False


class _Waited:
    """A collective's work whose wait() calls `done` once it returns."""

    def __init__(self, work, done):
        self._work, self._done = work, done

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._done()
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


class Spans:
    """Times calls as spans: ``fn = spans.timed(fn, "forward", "F")`` notes each call of fn, labelled
    F and its first argument (a micro-batch's number), in seconds from the last ``restart()``."""

    def __init__(self):
        self.events: list = []
        self.restart()

    def restart(self) -> None:
        self.start, self.events = time.perf_counter(), []

    def timed(self, fn, kind: str, prefix: str):
        def timed_call(*args, **kwargs):
            begin = time.perf_counter() - self.start
            result = fn(*args, **kwargs)
            self.events.append(
                {"kind": kind, "start": begin, "end": time.perf_counter() - self.start, "label": f"{prefix}{args[0]}"}
            )
            return result

        return timed_call


def idle_fractions(runs: list) -> list:
    """For the events of each rank (``Spans``, one shared start): the fraction of the step, from the
    start to the last event's end on any rank, that the rank spent in none of its spans."""
    length = max(e["end"] for events in runs for e in events)
    return [1 - sum(e["end"] - e["start"] for e in events) / length for events in runs]


def record_step(model_fn, wrap, x, y, warmup: int = 3) -> list:
    """Run on every rank: a few steps to warm up, then one step recorded; its events, in seconds."""
    model = model_fn()
    recorder = Recorder(model)
    model = wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(recorder=None):
        mark = recorder.now if recorder else (lambda: 0.0)
        t0 = mark()
        _, loss = model(x, y)
        t1 = mark()
        optimizer.zero_grad()
        loss.backward()
        t2 = mark()
        optimizer.step()
        t3 = mark()
        if recorder:
            recorder.span("forward", t0, t1)
            recorder.span("backward", t1, t2)
            recorder.span("step", t2, t3)

    for _ in range(warmup):
        step()
    dist.barrier()  # the ranks start the recorded step together
    with recorder:
        step(recorder)
    return [e for e in recorder.events if e["end"] is not None]


def record_steps(model_fn, wraps: dict, x, y) -> dict:
    """Run on every rank: record_step for each wrapper of wraps ({name: wrap}); the events by name."""
    return {name: record_step(model_fn, wrap, x, y) for name, wrap in wraps.items()}


def by_wrapper(per_rank: list) -> dict:
    """What record_steps returned on each rank, as {name: [events of rank 0, of rank 1, ...]}."""
    return {name: [events[name] for events in per_rank] for name in per_rank[0]}


# --- drawing, as SVG: no plotting library needed ----------------------------------------------------

_COLOURS = {"forward": "#8fb8de", "backward": "#4f81bd", "step": "#9bbb59", "allreduce": "#f79646", "grad": "#c0504d"}

# The lanes of each rank: (name, the kinds of event drawn in it), and the legend under them.
DATA_PARALLEL_LANES = (("compute", ("forward", "backward", "step")), ("all-reduce", ("allreduce",)))
DATA_PARALLEL_LEGEND = (
    "forward, backward (blue), optimizer step (green), all-reduce (orange), gradient ready (red line)"
)
PIPELINE_LANES = (("stage", ("forward", "backward")),)
PIPELINE_LEGEND = "forward Fi (light blue), backward Bi (dark blue) of micro-batch i; white: the stage is idle"


def svg(traces: dict, title: str, lanes: tuple = DATA_PARALLEL_LANES) -> str:
    """traces: {name: [events of rank 0, events of rank 1, ...]}; one panel per name, `lanes` per rank."""
    width, left, lane, gap = 900, 150, 18, 6
    longest = max(e["end"] for runs in traces.values() for events in runs for e in events) or 1e-6
    scale = (width - left - 20) / longest
    rows = sum(len(lanes) * len(runs) + 1 for runs in traces.values())
    height = 40 + rows * (lane + gap) + 30
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif"'
        ' font-size="11">',
        f'<text x="10" y="20" font-size="14">{html.escape(title)}</text>',
    ]
    y = 40
    for name, runs in traces.items():
        out.append(f'<text x="10" y="{y + 12}" font-weight="bold">{html.escape(name)}</text>')
        y += lane + gap
        for rank, events in enumerate(runs):
            for lane_name, kinds in lanes:
                out.append(f'<text x="10" y="{y + 12}">rank {rank} {lane_name}</text>')
                for e in (e for e in events if e["kind"] in kinds):
                    x, w = left + e["start"] * scale, max(1.0, (e["end"] - e["start"]) * scale)
                    tip = html.escape(f"{e['kind']} {e['label']} {e['start'] * 1e3:.2f}-{e['end'] * 1e3:.2f} ms")
                    out.append(
                        f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{lane}" fill="{_COLOURS[e["kind"]]}"'
                        f' stroke="#333" stroke-width="0.3"><title>{tip}</title></rect>'
                    )
                    if lanes is PIPELINE_LANES and w >= 8 * len(e["label"]):  # a micro-batch's name, where it fits
                        out.append(
                            f'<text x="{x + w / 2:.1f}" y="{y + 13}" text-anchor="middle">{html.escape(e["label"])}</text>'
                        )
                if lane_name == "compute":
                    for e in (e for e in events if e["kind"] == "grad"):
                        x = left + e["start"] * scale
                        out.append(
                            f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + lane}" stroke="{_COLOURS["grad"]}"'
                            f' stroke-width="2"><title>{html.escape(e["label"])} ready</title></line>'
                        )
                y += lane + gap
    ticks = [longest * k / 5 for k in range(6)]
    for t in ticks:
        x = left + t * scale
        out.append(f'<text x="{x:.1f}" y="{y + 12}" text-anchor="middle">{t * 1e3:.1f} ms</text>')
    legend = PIPELINE_LEGEND if lanes is PIPELINE_LANES else DATA_PARALLEL_LEGEND
    out.append(f'<text x="{left}" y="{y + 28}">{legend}</text>')
    out.append("</svg>")
    return "\n".join(out)


def write(path: str, traces: dict, title: str, lanes: tuple = DATA_PARALLEL_LANES) -> None:
    """The picture, as SVG: a browser opens it, and no plotting library is needed."""
    if not path.endswith(".svg"):
        raise SystemExit(f"--timeline writes SVG: name the file .svg (got {path})")
    with open(path, "w") as f:
        f.write(svg(traces, title, lanes))
