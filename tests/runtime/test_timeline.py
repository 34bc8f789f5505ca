"""`python mydp.py --timeline step.svg`: one step of MyDP and of OverlappedDP, recorded on every rank and drawn."""

import xml.etree.ElementTree as ET
from functools import partial

import pytest
import torch

from checks.helpers import CONFIG, SMALL, SMALL_BUCKET_MB, SmallMLP, global_batch, load, world
from course import timeline


def steps(folder):
    """Probe: the reference's wrappers, one recorded step each."""
    mydp = load(folder).mydp
    x, y = global_batch(CONFIG, 0, 1)
    wraps = {"MyDP": mydp.MyDP, "OverlappedDP": partial(mydp.OverlappedDP, bucket_cap_mb=SMALL_BUCKET_MB)}
    return timeline.record_steps(SmallMLP, wraps, x, y)


def test_a_step_is_recorded_and_drawn(impl_dir, tmp_path):
    traces = timeline.by_wrapper(world(steps, 2, impl_dir, expect=object))
    parameters = len(list(SmallMLP().parameters()))
    for name, runs in traces.items():
        assert len(runs) == 2, "one trace per rank"
        for events in runs:
            kinds = [e["kind"] for e in events]
            assert kinds.count("grad") == parameters and {"forward", "backward", "step"} <= set(kinds), kinds
            (backward,) = [e for e in events if e["kind"] == "backward"]
            reduces = [e for e in events if e["kind"] == "allreduce"]
            assert all(e["start"] <= e["end"] for e in events)
            if name == "MyDP":  # one all-reduce per parameter, each waited for inside its hook
                assert len(reduces) == parameters
                assert all(backward["start"] <= e["start"] and e["end"] <= backward["end"] for e in reduces), events
            else:  # SMALL's buckets: two, the first started while the backward pass still computes
                assert len(reduces) == 2 and reduces[0]["start"] < backward["end"], events
    path = tmp_path / "step.svg"
    timeline.write(str(path), traces, "one step on 2 ranks")
    drawing = ET.parse(path).getroot()
    labels = [t.text for t in drawing.iter("{http://www.w3.org/2000/svg}text")]
    assert labels.count("rank 1 all-reduce") == 2 and "MyDP" in labels and "OverlappedDP" in labels, labels
    rects = list(drawing.iter("{http://www.w3.org/2000/svg}rect"))
    assert len(rects) == sum(len([e for e in ev if e["kind"] != "grad"]) for runs in traces.values() for ev in runs)
    with pytest.raises(SystemExit, match="writes SVG"):
        timeline.write(str(tmp_path / "step.png"), traces, "")


def test_the_recorder_leaves_the_process_group_as_it_was():
    allreduce = vars(torch.distributed.ProcessGroup)["allreduce"]
    with timeline.Recorder(SmallMLP()):
        assert vars(torch.distributed.ProcessGroup)["allreduce"] is not allreduce
    assert vars(torch.distributed.ProcessGroup)["allreduce"] is allreduce


def pipeline_step(folder, schedule):
    """Probe: the reference's one recorded step of a pipeline (`python pp.py --timeline`), SMALL's MLP."""
    ex = load(folder)
    return ex.pp.record_step(ex.mlp.ModelConfig(**SMALL), schedule, 4, warmup=1)


def test_a_pipeline_step_is_recorded_and_drawn(impl_dir, tmp_path):
    """`python pp.py --timeline pp.svg`: each stage's forwards and backwards, as spans in the schedule's order."""
    traces = {name: world(pipeline_step, 2, impl_dir, name, expect=object) for name in ("gpipe", "1f1b")}
    orders = {"gpipe": ["F0 F1 F2 F3 B3 B2 B1 B0"] * 2, "1f1b": ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"]}
    for name, runs in traces.items():
        assert [" ".join(e["label"] for e in events) for events in runs] == orders[name], runs
        for events in runs:
            assert all(a["start"] <= a["end"] <= b["start"] for a, b in zip(events, events[1:])), events
        assert all(0 <= idle < 1 for idle in timeline.idle_fractions(runs))
    path = tmp_path / "pp.svg"
    timeline.write(str(path), traces, "one step on 2 stages", lanes=timeline.PIPELINE_LANES)
    drawing = ET.parse(path).getroot()
    labels = [t.text for t in drawing.iter("{http://www.w3.org/2000/svg}text")]
    assert labels.count("rank 1 stage") == 2 and "gpipe" in labels and "1f1b" in labels, labels
    rects = list(drawing.iter("{http://www.w3.org/2000/svg}rect"))
    assert len(rects) == sum(len(events) for runs in traces.values() for events in runs)
