"""``make gpu-check``: the reference solutions on this machine's GPUs, against the CPU.

    python -m course.instructors.gpu_check                      # the defaults of mlp.py, 300 steps
    python -m course.instructors.gpu_check --dim-hidden 2048    # any flag of mlp.py

Exercises 1 to 6 (7 adds no device-specific code to 6), 13 to 16 and 18: each case runs on the CPU
with gloo and on the GPUs with nccl, from the same seeds, in a world of one rank per GPU (one GPU
is enough; exercise 15's pipeline has at most one stage per layer). With one GPU, the multi-rank
cases run once more with two ranks sharing it over gloo (NCCL refuses two ranks on one GPU), so
that per-rank placement, DDP's device_ids and the ring meet CUDA tensors in a world of two.
The report gives the largest difference between the two and the median step times; a case that
fails shows why below the table, and the others still run. Last, one process's step time at a
larger size, on the CPU (a few steps) and on the GPU. The exit status says whether every case
agreed. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
import traceback
from dataclasses import asdict, dataclass, replace
from functools import cache, partial

import torch
import torch.distributed as dist

from course import impl
from course.device import current_device, using
from course.exercises import EXERCISES
from course.instructors.student import SOLUTIONS
from course.launch import WorldFailed, run

# Largest difference from the CPU that still counts as the same result. In float32, with matrix
# products pinned to IEEE (ieee_float32), GPU and CPU kernels differ in summation order only; the
# limit must still catch training that ran in bfloat16 by mistake (2.4e-4 from float32 on the
# CPU). With --amp both sides round to bfloat16's 8-bit mantissa, each its own way; the limit
# must still catch a learning rate of 0.2 instead of 0.1 (7.4e-2). Both limits come from those
# CPU figures; the first GPU run (one H100, torch 2.11, 2026-11-26) stayed well within them:
# 1.0e-7 in float32, 2.0e-4 with --amp.
TOLERANCE = {False: 1e-5, True: 2e-3}
MATMUL_SHAPE = (1000, 700, 500)  # no side divides by a small world size: the padding is exercised
# Exercise 13 trains with Adam at fsdp.py's own rate. At mlp.py's 0.1, set for SGD, Adam diverges
# and where it ends is chaotic: a 1e-7 nudge of the initial weights moved the final loss by up to 0.9.
FSDP_LR = 1e-3
# The exercises whose rows run on more than one rank: all but exercise 1, which trains one process.
MULTI_RANK = {exercise.number for exercise in EXERCISES if exercise.gpu} - {1}
RING_LENGTH = 100_003  # not a multiple either; its sums over 16 ranks stay below 2**24, exact in float32


@dataclass
class Row:
    case: str
    world_size: int
    difference: float  # largest |accelerator - CPU| over parameters, or relative over C
    tolerance: float
    step_ms: tuple | None = None  # median step time (CPU, accelerator)
    error: str = ""  # why the case could not run, when it could not

    @property
    def ok(self) -> bool:
        return not self.error and self.difference <= self.tolerance


@contextlib.contextmanager
def ieee_float32():
    """float32 matrix products in full float32 on the GPU for the duration of a with block.

    Where TF32 is allowed (fp32_precision "tf32", set by a user or a site's startup code), GPUs
    from Ampere on multiply float32 matrices with a 10-bit mantissa: training then drifts from
    the CPU nearly as far as with bfloat16, and the float32 limit could not tell the two apart.
    """
    before = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


def _train(folder: str, fields: dict, wrap=None) -> dict:
    """train() of exercise 1 with its progress lines silenced: the report says what matters."""
    mlp = impl.load(folder).mlp
    with contextlib.redirect_stdout(io.StringIO()), ieee_float32():
        result = mlp.train(mlp.ModelConfig(**fields), wrap=wrap or mlp.wrap_ddp)
    return {"state": {k: v.cpu() for k, v in result["state"].items()}, "step_ms": result["step_ms"]}


def train_on_rank(folder: str, fields: dict, wrap_name: str):
    """Worker: train data-parallel with DDP, MyDP or OverlappedDP; rank 0 returns its parameters and step time."""
    ex = impl.load(folder)
    wraps = {"ddp": ex.mlp.wrap_ddp, "mydp": ex.mydp.MyDP, "overlapped": partial(ex.mydp.OverlappedDP, bucket_cap_mb=1)}
    result = _train(folder, fields, wraps[wrap_name])
    return result if dist.get_rank() == 0 else None


def pipeline_on_rank(folder: str, fields: dict):
    """Worker: exercise 15's 1F1B pipeline, one stage per rank; the last rank returns the whole trained model."""
    ex = impl.load(folder)
    with contextlib.redirect_stdout(io.StringIO()), ieee_float32():
        result = ex.pp.train(ex.mlp.ModelConfig(**fields), "1f1b", 4)
    return result if dist.get_rank() == dist.get_world_size() - 1 else None


def ring_on_rank(folder: str, length: int):
    """Worker: exercise 5's ring_all_reduce of whole numbers (exact sums); rank 0 returns the sum."""
    ring = torch.arange(length, dtype=torch.float32, device=current_device()) * (dist.get_rank() + 1)
    impl.load(folder).dist.ring_all_reduce(ring)
    return ring.cpu() if dist.get_rank() == 0 else None


def tp_on_rank(folder: str, fields: dict):
    """Worker: exercise 14's training, tensor parallel and then sequence parallel too, silenced; rank 0
    returns each one's figures: its loss, one process's beside it, and its step time."""
    ex = impl.load(folder)
    with contextlib.redirect_stdout(io.StringIO()), ieee_float32():
        results = [ex.tp.train(ex.mlp.ModelConfig(**fields), sequence_parallel) for sequence_parallel in (False, True)]
    return results if dist.get_rank() == 0 else None


def mesh_on_rank(folder: str, fields: dict):
    """Worker: exercise 16's training on the mesh (W / 2, 2) (W odd: (W, 1)), silenced; rank 0 returns its
    figures: its loss, one process's beside it, and its step time."""
    ex = impl.load(folder)
    tp = 2 if dist.get_world_size() % 2 == 0 else 1
    with contextlib.redirect_stdout(io.StringIO()), ieee_float32():
        result = ex.nd.train(ex.mlp.ModelConfig(**fields), dist.get_world_size() // tp, tp)
    return result if dist.get_rank() == 0 else None


def moe_on_rank(folder: str, fields: dict):
    """Worker: exercise 18's training on the mesh (W / 2, 2) (W odd: (1, W)), 2 experts per rank, top 2, a capacity
    factor of 1 (some tokens dropped), silenced; rank 0 returns its figures: its loss, one process's beside it, and
    its step time."""
    ex = impl.load(folder)
    ep = 2 if dist.get_world_size() % 2 == 0 else dist.get_world_size()
    with contextlib.redirect_stdout(io.StringIO()), ieee_float32():
        result = ex.moe.train(ex.mlp.ModelConfig(**fields), dist.get_world_size() // ep, ep, 2, 2, 1.0, 0.01)
    return result if dist.get_rank() == 0 else None


def fsdp_on_rank(folder: str, fields: dict):
    """Worker: exercise 13's ZeRO-2 and ZeRO-3 training, then ZeRO-3 with bfloat16 gathers, then
    built-in DDP, at fsdp.py's learning rate, silenced; rank 0 returns each one's figures (final
    test loss, step time)."""
    fsdp = impl.load(folder).fsdp
    config = replace(fsdp.ModelConfig(**fields), lr=FSDP_LR)
    with contextlib.redirect_stdout(io.StringIO()), ieee_float32():
        runs = [fsdp.train(config, "zero2"), fsdp.train(config, "zero3")]
        runs.append(fsdp.train(replace(config, amp=True), "zero3"))
        runs.append(fsdp.train(config, "ddp"))
    return [{"test_loss": r["test_loss"], "step_ms": r["step_ms"]} for r in runs] if dist.get_rank() == 0 else None


def matmul_on_rank(folder: str, m: int, k: int, n: int):
    """Worker: both distributed matrix products of exercise 2; rank 0 returns them."""
    ex = impl.load(folder)
    A = B = None
    if dist.get_rank() == 0:
        A, B = (t.to(current_device()) for t in matrices(m, k, n))
    with current_device(), ieee_float32():  # the buffers the exercise makes must be on the device too
        products = ex.dist.par_matmul_by_row(A, B), ex.dist.par_matmul_by_reduction(A, B)
    return [C.cpu() for C in products] if dist.get_rank() == 0 else None


def matrices(m: int, k: int, n: int) -> tuple:
    """A and B as dist.py makes them for --shape M K N."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)


def _train_here(folder: str, fields: dict, device: str) -> dict:
    with using(device):
        return _train(folder, fields)


def compare(
    device: str,
    world_size: int,
    config,
    folder: str = SOLUTIONS,
    reference: str | None = None,
    backend: str = "",
    exercises: set | None = None,
) -> list:
    """Run every case on the CPU and on ``device`` ("cuda", or "cpu" to check this check); one Row each.

    ``folder`` holds the code run on ``device``, ``reference`` (the same when None) the code run on
    the CPU: the tests plant a mistake in one of them. ``backend`` on the device: nccl for "cuda"
    unless given (gloo: ranks may share a GPU). ``exercises``: only their cases (all when None).
    A case that fails still gets its row, with the reason, and the cases after it still run.
    """
    reference = reference or folder
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    on_cpu = (reference, dict(backend="gloo", device="cpu"))
    on_device = (folder, dict(backend=backend, device=device))
    ex = impl.load(folder)
    fields = asdict(config)
    stages = min(world_size, config.n_layers)

    def alone():
        return _training_difference(
            ex,
            [
                _train_here(code, fields, where)
                for code, where in ((reference, "cpu"), (folder, "cuda:0" if device == "cuda" else "cpu"))
            ],
        )

    def matmul():
        reference = torch.matmul(*matrices(*MATMUL_SHAPE))
        products = run(matmul_on_rank, world_size, folder, *MATMUL_SHAPE, **on_device[1])[0]
        return max(ex.dist.relative_difference(C, reference) for C in products), None

    def data_parallel(wrap_name, amp=False):
        fields_here = fields | {"amp": amp}
        return lambda: _training_difference(
            ex,
            [
                run(train_on_rank, world_size, code, fields_here, wrap_name, **where)[0]
                for code, where in (on_cpu, on_device)
            ],
        )

    def pipeline():
        return _training_difference(
            ex, [run(pipeline_on_rank, stages, code, fields, **where)[-1] for code, where in (on_cpu, on_device)]
        )

    def ring():
        summed = run(ring_on_rank, world_size, folder, RING_LENGTH, **on_device[1])[0]
        exact = torch.arange(RING_LENGTH, dtype=torch.float32) * (world_size * (world_size + 1) // 2)
        return (summed - exact).abs().max().item(), None

    # ParallelMLP pairs the layers: an odd count gets one hidden layer more. One world per device for both rows.
    even = fields | {"n_layers": fields["n_layers"] + fields["n_layers"] % 2}
    tensor_parallel_runs = cache(
        lambda: [run(tp_on_rank, world_size, code, even, **where)[0] for code, where in (on_cpu, on_device)]
    )

    fsdp_runs = cache(
        lambda: [run(fsdp_on_rank, world_size, code, fields, **where)[0] for code, where in (on_cpu, on_device)]
    )

    def sharded(*which, against_ddp=False):
        """The largest difference of the final test loss over the runs `which` of fsdp_on_rank, from
        the CPU's and, `against_ddp`, from built-in DDP's on the same device (equal on the CPU)."""

        def measure():
            cpu, other = fsdp_runs()
            difference = max(abs(other[i]["test_loss"] - cpu[i]["test_loss"]) for i in which)
            if against_ddp:
                difference = max(difference, *(abs(other[i]["test_loss"] - other[-1]["test_loss"]) for i in which))
            return difference, (cpu[which[-1]]["step_ms"], other[which[-1]]["step_ms"])

        return measure

    def tensor_parallel(sequence_parallel):
        def measure():
            return _loss_difference(*(both[sequence_parallel] for both in tensor_parallel_runs()))

        return measure

    def mesh():
        return _loss_difference(
            *(run(mesh_on_rank, world_size, code, even, **where)[0] for code, where in (on_cpu, on_device))
        )

    def experts():
        return _loss_difference(
            *(run(moe_on_rank, world_size, code, fields, **where)[0] for code, where in (on_cpu, on_device))
        )

    measures = {  # by row, as course/exercises.py names them: (world size, tolerance, measure)
        "1 MLP, one process": (1, TOLERANCE[config.amp], alone),
        "2 matmul, by row and by reduction": (world_size, ex.dist.MATMUL_TOLERANCE, matmul),
        "3 DDP": (world_size, TOLERANCE[False], data_parallel("ddp")),
        "3 DDP --amp": (world_size, TOLERANCE[True], data_parallel("ddp", amp=True)),
        "4 MyDP": (world_size, TOLERANCE[False], data_parallel("mydp")),
        "4 MyDP --amp": (world_size, TOLERANCE[True], data_parallel("mydp", amp=True)),
        "5 ring all-reduce": (world_size, 0.0, ring),
        "6 OverlappedDP, 1 MiB buckets": (world_size, TOLERANCE[False], data_parallel("overlapped")),
        "13 ZeRO-2 and ZeRO-3 (final test loss)": (world_size, TOLERANCE[False], sharded(0, 1, against_ddp=True)),
        "13 ZeRO-3, bfloat16 gathers (final test loss)": (world_size, TOLERANCE[True], sharded(2)),
        "14 tensor parallel (final loss)": (world_size, TOLERANCE[False], tensor_parallel(False)),
        "14 sequence parallel (final loss)": (world_size, TOLERANCE[False], tensor_parallel(True)),
        "15 pipeline, 1F1B": (stages, TOLERANCE[False], pipeline),
        "16 data x tensor parallel mesh (final loss)": (world_size, TOLERANCE[False], mesh),
        "18 expert parallel, dp x ep mesh (final loss)": (world_size, TOLERANCE[False], experts),
    }
    missing = [row for exercise in EXERCISES for row in exercise.gpu if row not in measures]
    if missing:
        raise ValueError(f"rows of course/exercises.py with no measure here: {missing}")
    chosen = [e for e in EXERCISES if exercises is None or e.number in exercises]
    return [_row(row, *measures[row]) for exercise in chosen for row in exercise.gpu]


def _row(case: str, world_size: int, tolerance: float, measure) -> Row:
    try:
        difference, step_ms = measure()
    except Exception as failure:  # noqa: BLE001 - the other cases' rows are still worth having
        reason = str(failure) if isinstance(failure, WorldFailed) else traceback.format_exc()
        return Row(case, world_size, math.nan, tolerance, error=reason)
    return Row(case, world_size, difference, tolerance, step_ms)


def _loss_difference(cpu: dict, other: dict) -> tuple:
    """Of runs that train one process beside them: the largest difference of the device's final loss from the
    CPU's and from one process's on the same device, and both step times."""
    difference = max(abs(other["train_loss"] - cpu["train_loss"]), abs(other["train_loss"] - other["one_process_loss"]))
    return difference, (cpu["step_ms"], other["step_ms"])


def _training_difference(ex, results: list) -> tuple:
    """Largest parameter difference between the CPU's and the device's training, and both step times."""
    cpu, other = results
    return ex.mydp.largest_difference(cpu["state"], other["state"]), (cpu["step_ms"], other["step_ms"])


def report(rows: list, device_name: str) -> str:
    lines = [
        f"{'case':<36}{'world':>6}{'max |diff|':>12}{'limit':>9}{'CPU ms/step':>13}{device_name + ' ms/step':>16}  agree",
    ]
    for row in rows:
        times = f"{row.step_ms[0]:>13.2f}{row.step_ms[1]:>16.2f}" if row.step_ms else f"{'':>13}{'':>16}"
        verdict = "failed, see below" if row.error else "yes" if row.ok else "NO"
        lines.append(f"{row.case:<36}{row.world_size:>6}{row.difference:>12.2e}{row.tolerance:>9.0e}{times}  {verdict}")
    by_case = {row.case: row for row in rows}
    alone, ddp = by_case.get("1 MLP, one process"), by_case.get("3 DDP")
    if alone and ddp and alone.step_ms and ddp.step_ms:
        lines.append("\n" + data_parallel_pays(device_name, alone.step_ms[1], ddp.step_ms[1], ddp.world_size))
    for row in rows:
        if row.error:
            lines.append(f"\n{row.case} failed:\n{row.error.rstrip()}")
    agreed = sum(row.ok for row in rows)
    lines.append(
        f"{agreed} of {len(rows)} cases agree with the CPU."
        + ("" if agreed == len(rows) else " See the rows marked NO or failed.")
    )
    return "\n".join(lines)


def data_parallel_pays(device_name: str, t_comp: float, t_step: float, ranks: int) -> str:
    """What one process's and DDP's step times say, in sentences that hold for any number of ranks."""
    t_sync = max(t_step - t_comp, 0.0)
    said = (
        f"On {device_name}: one process {t_comp:.2f} ms a step, DDP on {ranks} rank(s) {t_step:.2f} ms a step:"
        f" T_sync is about {t_sync:.2f} ms, T_sync/T_comp = {t_sync / t_comp:.2f}."
    )
    if ranks == 1:
        return said + (
            " With one rank nothing is shared: that is DDP's cost alone, which R ranks repay when"
            " T_sync/T_comp stays below R - 1."
        )
    speedup = ranks * t_comp / t_step
    return said + (
        f" {ranks} ranks process {speedup:.2f}x the examples per second of one process: data parallelism"
        f" pays when T_sync/T_comp is below R - 1 = {ranks - 1}, and {'does' if speedup > 1 else 'does not'} here."
    )


# A size that shows what a GPU is for: about 5e11 floating-point operations a step, a second or so
# on a CPU, milliseconds on one GPU. The CPU runs a few steps only, so that the check stays short.
GPU_SIZE = {"d_hidden": 4096, "batch_size": 2048}
SIZE_STEPS = {"cpu": 3, "device": 100}


def size_up(device: str, config, changes: dict = GPU_SIZE, steps: dict = SIZE_STEPS) -> str:
    """One process's step time at a larger size on the CPU (a few steps) and on ``device``, in one line."""
    fields = asdict(config) | changes
    cpu = _train_here(SOLUTIONS, fields | {"niters": steps["cpu"]}, "cpu")["step_ms"]
    where = "cuda:0" if device == "cuda" else device
    other = _train_here(SOLUTIONS, fields | {"niters": steps["device"]}, where)["step_ms"]
    size = ", ".join(f"{name} {value}" for name, value in changes.items())
    return (
        f"At {size}: one process on the CPU {cpu:.1f} ms a step ({steps['cpu']} steps), on {where}"
        f" {other:.2f} ms a step ({steps['device']} steps): {cpu / other:.0f}x."
    )


def main(argv: list | None = None) -> int:
    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("gpu-check: no GPU here (torch.cuda.device_count() is 0); nothing to check.")
        return 0
    mlp = impl.load(SOLUTIONS).mlp
    parser = mlp.make_parser(__doc__)
    parser.set_defaults(niters=300)
    config = mlp.config_from(parser.parse_args(argv))
    print(f"gpu-check: {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"world size {gpus} (one rank per GPU), nccl; CPU reference with gloo; config {config}")
    rows = compare("cuda", gpus, config)
    print(report(rows, "GPU"))
    if gpus == 1:  # the multi-rank cases once more, with 2 ranks on the one GPU: NCCL would refuse them
        print("\nTwo ranks sharing the GPU, over gloo (CUDA tensors): the multi-rank cases again.")
        shared = compare("cuda", 2, config, backend="gloo", exercises=MULTI_RANK)
        print(report(shared, "GPU, 2 ranks"))
        rows += shared
    print("\n" + size_up("cuda", config))
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
