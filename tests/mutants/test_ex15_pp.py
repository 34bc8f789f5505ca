"""The checks of exercise 15 catch the mistakes of a pipeline, and its hangs are reported within seconds.

Instructors only: these need solutions/. Each case makes a mutant of the reference with one
mistake and shows that the check for it fails, with a message that points at the mistake. The
hangs are the launcher's own diagnosis (course/runtime/failure.py), proven on a pipeline: every rank's
line in pp.py and the message it waits for, one collective timeout after the messages stopped.
"""

import re
import time

import pytest

from checks.test_ex15_pp import (
    check_gradients,
    check_matches_torch,
    check_memory,
    check_messages,
    check_order,
    check_stage_layers,
    check_training,
)
from course.launch import WorldFailed
from course.layout import SOLUTIONS
from course.runtime import env
from tests import warm
from tests.mutants import assert_caught, assert_refused, assert_torch_own_caught, make_mutant
from tests.own_time import Watch

SEND_BACK = "        return [] if self.rank == 0 else [(inputs.grad, self.rank - 1)]\n"
WAIT_ALL = """    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
"""
WARMUP_ONE_SHORT = "    warmup = min(max(p - s - 2, 0), m)"
LAST_SENDS_NOTHING = "        return [] if last else [(output.detach(), self.rank + 1)]\n"

OPS = (
    "    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]\n"
    "    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in receives]\n"
)
FORWARD_INPUT = "        inputs = x if received is None else received.requires_grad_()\n"

MUTANTS = {
    "stage_layers returns lists, not ranges": (
        "pp.py",
        "        stages.append(range(start, stop))",
        "        stages.append(list(range(start, stop)))",
        check_stage_layers,
        "stage_layers(6, 4) returned a list of lists: it returns a list of ranges",
    ),
    "GPipe's events lists, not tuples": (
        "pp.py",
        '    return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]',
        '    return [["F", i] for i in range(m)] + [["B", i] for i in reversed(range(m))]',
        lambda folder: check_order(folder, "gpipe"),
        "gpipe(4, 2, 0) returned a list of list: a schedule is a list of tuples",
    ),
    "Pipeline.run's loss a tensor, not a float": (
        "pp.py",
        "            self.loss += output.item()",
        "            self.loss += output",
        lambda folder: check_gradients(folder, "1f1b"),
        "Pipeline.run returned a Tensor on the last stage; it returns the batch's loss as a float",
    ),
    "the first stage handled apart, as if it never were the last": (
        "pp.py",
        FORWARD_INPUT,
        "        if self.rank == 0:\n"
        "            output = self.stage(x)\n"
        "            self.kept[i] = (x, output)\n"
        "            return [(output.detach(), self.rank + 1)]\n" + FORWARD_INPUT,
        check_training,
        "a pipeline of one stage (p=1, m=3) failed",
    ),
    "communicate starts the first send and receive only": (
        "pp.py",
        OPS,
        OPS.replace("in sends]", "in sends[:1]]").replace("in receives]", "in receives[:1]]"),
        check_messages,
        "it starts every send and every receive of the lists",
    ),
    "overlapping stages": (
        "pp.py",
        "        stages.append(range(start, stop))",
        "        stages.append(range(max(0, start - 1), stop))",
        check_stage_layers,
        "the stages must not overlap",
    ),
    "the last stages longer": (
        "pp.py",
        "(1 if s < n_layers % world_size else 0)",
        "(1 if s >= world_size - n_layers % world_size else 0)",
        check_stage_layers,
        "the first 6 % 4 = 2 of them one layer longer",
    ),
    "the 1/m scale missing, against torch": (
        "pp.py",
        "    return F.cross_entropy(logits, targets) / m",
        "    return F.cross_entropy(logits, targets)",
        lambda folder: check_matches_torch(folder, "gpipe"),
        "6.0x torch's PipelineStage with ScheduleGPipe's on the same stages, m = 6: scale each micro-batch's loss",
    ),
    "the 1/m scale missing": (
        "pp.py",
        "    return F.cross_entropy(logits, targets) / m",
        "    return F.cross_entropy(logits, targets)",
        lambda folder: check_gradients(folder, "gpipe"),
        "scale each micro-batch's loss by 1/m",
    ),
    "GPipe's backwards in forward order": (
        "pp.py",
        '[("B", i) for i in reversed(range(m))]',
        '[("B", i) for i in range(m)]',
        lambda folder: check_order(folder, "gpipe"),
        "the backwards ran in forward order",
    ),
    "GPipe as 1F1B: the memory": (
        "pp.py",
        '    return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]',
        "    return one_f_one_b(m, p, s)",
        lambda folder: check_memory(folder, "gpipe"),
        "GPipe keeps all 6 until the backwards",
    ),
    "1F1B's warm-up one forward too long": (
        "pp.py",
        "    warmup = min(p - s - 1, m)",
        "    warmup = min(p - s, m)",
        lambda folder: check_order(folder, "1f1b"),
        "1 warm-up forward too many",
    ),
    "1F1B's warm-up counted from the wrong end": (
        "pp.py",
        "    warmup = min(p - s - 1, m)",
        "    warmup = min(s, m)",
        lambda folder: check_order(folder, "1f1b"),
        "stage 0 waits at B0 for B0 of stage 1, which comes after its F1",
    ),
    "1F1B's warm-up not capped at m": (
        "pp.py",
        "    warmup = min(p - s - 1, m)",
        "    warmup = p - s - 1",
        lambda folder: check_order(folder, "1f1b"),
        "one_f_one_b(2, 4, 0) returned F0 F1 F2 B-1 B0 B1: F2 is no micro-batch's forward or backward",
    ),
    "1F1B's steady phase running each backward before its forward": (
        "pp.py",
        '        events += [("F", warmup + i), ("B", i)]',
        '        events += [("B", i), ("F", warmup + i)]',
        lambda folder: check_memory(folder, "1f1b"),
        "B0 comes before F0",
    ),
    "1F1B's schedule a generator, empty once read": (
        "pp.py",
        '    return events + [("B", i) for i in range(m - warmup, m)]',
        '    yield from events + [("B", i) for i in range(m - warmup, m)]',
        check_training,
        "a schedule is a list (a generator is empty once read)",
    ),
    "micro-batches kept after their backward": (
        "pp.py",
        "        inputs, output = self.kept.pop(i)",
        "        inputs, output = self.kept[i]",
        lambda folder: check_memory(folder, "1f1b"),
        "the inputs or outputs of micro-batches [0, 1, 2, 3, 4, 5] still after the step",
    ),
    "batch_isend_irecv given an empty list": (
        "pp.py",
        WAIT_ALL,
        "    for request in dist.batch_isend_irecv(ops):\n        request.wait()\n",
        lambda folder: check_gradients(folder, "gpipe"),
        "called dist.batch_isend_irecv with no message to send or receive (pp.py:",
    ),
    "1F1B's warm-up one forward too long: the memory": (
        "pp.py",
        "    warmup = min(p - s - 1, m)",
        "    warmup = min(p - s, m)",
        lambda folder: check_memory(folder, "1f1b"),
        "1F1B at most p - s = 3",
    ),
    "1F1B as GPipe": (
        "pp.py",
        "    warmup = min(p - s - 1, m)",
        "    warmup = m",
        lambda folder: check_order(folder, "1f1b"),
        "4 forwards before the first backward",
    ),
    "the received activation asks for no gradient": (
        "pp.py",
        "        inputs = x if received is None else received.requires_grad_()",
        "        inputs = x if received is None else received",
        lambda folder: check_gradients(folder, "1f1b"),
        "asks for no gradient",
    ),
    "a detached output kept for the backward": (
        "pp.py",
        "        self.kept[i] = (inputs, output)",
        "        self.kept[i] = (inputs, output.detach())",
        lambda folder: check_gradients(folder, "gpipe"),
        "started from a tensor with no graph",
    ),
    "the backward keeps the graph": (
        "pp.py",
        "        output.backward(received)",
        "        output.backward(received, retain_graph=True)",
        lambda folder: check_memory(folder, "1f1b"),
        "no retain_graph",
    ),
    "every message sent twice": (
        "pp.py",
        "    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]\n",
        "    sends, receives = sends * 2, receives * 2\n    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]\n",
        check_messages,
        "one each way per micro-batch between neighbours",
    ),
    "a shape sent with each activation": (
        "pp.py",
        "    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in receives]\n",
        "    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in receives]\n"
        "    ops += [dist.P2POp(dist.isend, torch.tensor(t.shape), peer) for t, peer in sends]\n"
        "    ops += [dist.P2POp(dist.irecv, torch.tensor(t.shape), peer) for t, peer in receives]\n",
        check_messages,
        "every message is one micro-batch's activation or gradient",
    ),
    "sends waited for at the next call only": (
        "pp.py",
        WAIT_ALL,
        "    for request in PENDING:\n        request.wait()\n"
        "    requests = dist.batch_isend_irecv(ops) if ops else []\n"
        "    PENDING[:] = requests[: len(sends)]\n"
        "    for request in requests[len(sends) :]:\n        request.wait()\n\n\nPENDING = []\n",
        check_messages,
        "was never waited for",
    ),
    "the last stage's step scaled twice": (
        "pp.py",
        "            self.loss += output.item()",
        "            self.loss += output.item() / self.m",
        lambda folder: check_gradients(folder, "1f1b"),
        "one process's on the whole batch is",
    ),
    "the received gradient ignored": (
        "pp.py",
        "        output.backward(received)",
        "        output.backward(received if received is None else torch.ones_like(received))",
        check_training,
        "differs from one process trained on the whole batches",
    ),
    "the received gradient doubled, against torch": (
        "pp.py",
        "        output.backward(received)",
        "        output.backward(received if received is None else 2 * received)",
        lambda folder: check_matches_torch(folder, "1f1b"),
        "is 4.00x torch's PipelineStage with Schedule1F1B's",  # doubled at each of 2 stages
    ),
}


@pytest.mark.parametrize("mistake", sorted(MUTANTS))
def test_mistake_is_caught(mistake, tmp_path):
    assert_caught(tmp_path / "mutant", mistake, *MUTANTS[mistake])


# Issue 47: the messages sent by torch's pipelining (its batched sends and receives), which the exercise writes by
# hand: every check passes it with the exercise forbidding nothing (assert_torch_own_caught's control).
TORCH_OWN = (
    "pp.py",
    "        for request in dist.batch_isend_irecv(ops):\n",
    "        from torch.distributed.pipelining.schedules import _batch_p2p\n\n        for request in _batch_p2p(ops):\n",
    check_messages,
    "pipelining",
)


def test_torch_own_pipelining_is_caught(tmp_path, monkeypatch):
    assert_torch_own_caught(tmp_path / "mutant", "messages by torch's pipelining", *TORCH_OWN, monkeypatch)


def test_no_order_message_answers_the_todo(tmp_path):
    """A miscounted 1F1B warm-up is said as too few or too many forwards, never with the count's formula,
    the answer to the TODO's question."""
    folder = make_mutant(tmp_path / "mutant", "pp.py", "    warmup = min(p - s - 1, m)", WARMUP_ONE_SHORT)
    with pytest.raises(AssertionError) as caught:
        check_order(folder, "1f1b")
    assert "too few" in str(caught.value) and "p - s - 1" not in str(caught.value), str(caught.value)


# Hangs a student causes. Each: the mutant, the check that meets it, what each rank waits in, and the
# advice of the report (blocking calls on both sides, or messages started that do not match).
HANGS = {
    "both stages receiving first": (
        WAIT_ALL,
        "    for t, peer in receives:\n        dist.recv(t, peer)\n    for t, peer in sends:\n        dist.send(t, peer)\n",
        lambda folder: check_order(folder, "1f1b"),
        [("recv", 1), ("recv", 0)],
        "Start sends and receives with isend/irecv before waiting for any",
    ),
    "both stages sending first": (
        WAIT_ALL,
        "    for t, peer in sends:\n        dist.send(t, peer)\n    for t, peer in receives:\n        dist.recv(t, peer)\n",
        lambda folder: check_order(folder, "1f1b"),
        [("send", 1), ("send", 0)],
        "Start sends and receives with isend/irecv before waiting for any",
    ),
    "a send with no matching receive (the last stage sends its loss on)": (
        LAST_SENDS_NOTHING,
        "        return [(output.detach(), (self.rank + 1) % self.world_size)]\n",
        check_messages,
        [("isend", 1), ("isend", 2), ("isend", 0)],
        "A send to rank r needs rank r to receive from this rank",
    ),
    "a backward sent to the wrong stage": (
        SEND_BACK,
        "        return [] if self.rank == 0 else [(inputs.grad, (self.rank + 1) % self.world_size)]\n",
        check_messages,
        [("isend", 1), ("irecv", 2), ("isend", 0)],
        "A send to rank r needs rank r to receive from this rank",
    ),
}


@pytest.mark.parametrize("hang", sorted(HANGS))
def test_a_hang_is_reported_within_seconds(hang, tmp_path):
    old, new, check, waits, advice = HANGS[hang]
    folder = make_mutant(tmp_path / "mutant", "pp.py", old, new)
    with Watch() as watch, pytest.raises(WorldFailed) as caught:
        start = time.time()
        try:
            check(folder)
        finally:
            end = time.time()
    seconds = watch.own_between(start, end)  # the worlds' own time, as their waits and limits count
    failure = caught.value.failure
    assert failure.kind == "p2p_deadlock" and advice in failure.report(), failure.report()
    assert [(f.collective, f.peer) for f in failure.ranks] == waits, failure.report()
    assert {(f.file, f.func) for f in failure.ranks} == {("pp.py", "communicate")}, failure.report()
    preposition = {"send": "to", "isend": "to", "recv": "from", "irecv": "from"}
    for f, (call, peer) in zip(failure.ranks, waits):
        assert f"rank {f.rank} waits in {call} {preposition[call]} rank {peer} at pp.py:" in failure.report()
    # The report comes one message timeout after the messages stopped, plus the worlds' starts and runs.
    assert seconds < float(env.CHECK_SETTINGS["COURSE_COLLECTIVE_TIMEOUT"]) + 6, (
        f"{hang} was reported after {seconds:.1f} s of the worlds' own time"
    )


def test_the_script_trains_as_one_process():
    """`python pp.py --world-size 3 --schedule 1f1b`: the pipeline's test loss is one process's."""
    small = ["--n-layers", "4", "--dim-in", "12", "--n-classes", "4", "--dim-hidden", "10", "--train-size", "160"]
    done = warm.run(
        ["pp.py", "--world-size", "3", "--schedule", "1f1b", *small, "--batch-size", "8", "--niters", "30"],
        cwd=SOLUTIONS,
    )
    assert done.returncode == 0, done.stderr
    final = re.search(
        r"test_loss ([\d.]+) \| one process: test_loss ([\d.]+) \| largest weight difference (\S+)", done.stdout
    )
    assert final and final[1] == final[2] and float(final[3]) < 1e-5, done.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["--n-layers", "1"], "--n-layers 1 cannot give each of --world-size 2 stages a layer"),
        (["--micro-batches", "0"], "--micro-batches 0: a batch splits into 1 micro-batch or more"),
    ],
)
def test_sizes_the_script_cannot_take_are_refused(args, words):
    """The smallest sizes the parser takes, where the model cannot be split so: one line, before any world."""
    assert_refused("pp.py", args, words)
