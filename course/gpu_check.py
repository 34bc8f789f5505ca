"""``make gpu-check``: the reference solutions on this machine's GPUs, against the CPU.

    python -m course.gpu_check                      # the defaults of mlp.py, 300 steps
    python -m course.gpu_check --dim-hidden 2048    # any flag of mlp.py

Exercises 1 to 6 (7 adds no device-specific code to 6): each case runs on the CPU with gloo and on
the GPUs with nccl, from the same seeds, in a world of one rank per GPU (one GPU is enough). The report gives the largest difference between
the two and the median step times, and the exit status says whether every case agreed. Without
a GPU it says so and exits 0.
"""

from __future__ import annotations

import contextlib
import io
import sys
from dataclasses import asdict, dataclass
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from course import impl
from course.device import current_device, using
from course.launch import run
from course.student import SOLUTIONS

# Largest difference from the CPU that still counts as the same result. float32 kernels differ
# in summation order only; bfloat16 keeps 8 bits of mantissa, so a few hundred steps drift further.
TOLERANCE = {False: 1e-3, True: 5e-2}
MATMUL_SHAPE = (1000, 700, 500)  # no side divides by a small world size: the padding is exercised
RING_LENGTH = 100_003  # not a multiple either; its sums over 16 ranks stay below 2**24, exact in float32


@dataclass
class Row:
    case: str
    world_size: int
    difference: float  # largest |accelerator - CPU| over parameters, or relative over C
    tolerance: float
    step_ms: Optional[tuple] = None  # median step time (CPU, accelerator)

    @property
    def ok(self) -> bool:
        return self.difference <= self.tolerance


def _train(folder: str, fields: dict, wrap=None) -> dict:
    """train() of exercise 1 with its progress lines silenced: the report says what matters."""
    mlp = impl.load(folder).mlp
    with contextlib.redirect_stdout(io.StringIO()):
        result = mlp.train(mlp.ModelConfig(**fields), wrap=wrap or mlp.wrap_ddp)
    return {"state": {k: v.cpu() for k, v in result["state"].items()}, "step_ms": result["step_ms"]}


def train_on_rank(folder: str, fields: dict, wrap_name: str):
    """Worker: train data-parallel with DDP, MyDP or OverlappedDP; rank 0 returns its parameters and step time."""
    ex = impl.load(folder)
    wraps = {"ddp": ex.mlp.wrap_ddp, "mydp": ex.mydp.MyDP, "overlapped": partial(ex.mydp.OverlappedDP, bucket_cap_mb=1)}
    result = _train(folder, fields, wraps[wrap_name])
    return result if dist.get_rank() == 0 else None


def ring_on_rank(folder: str, length: int):
    """Worker: exercise 5's ring_all_reduce of whole numbers (exact sums); rank 0 returns the sum."""
    ring = torch.arange(length, dtype=torch.float32, device=current_device()) * (dist.get_rank() + 1)
    impl.load(folder).dist.ring_all_reduce(ring)
    return ring.cpu() if dist.get_rank() == 0 else None


def matmul_on_rank(folder: str, m: int, k: int, n: int):
    """Worker: both distributed matrix products of exercise 2; rank 0 returns them."""
    ex = impl.load(folder)
    A = B = None
    if dist.get_rank() == 0:
        A, B = (t.to(current_device()) for t in _matrices(m, k, n))
    with current_device():  # the buffers the exercise makes must be on the device too
        products = ex.dist.par_matmul_by_row(A, B), ex.dist.par_matmul_by_reduction(A, B)
    return [C.cpu() for C in products] if dist.get_rank() == 0 else None


def _matrices(m: int, k: int, n: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)


def _train_here(folder: str, fields: dict, device: str) -> dict:
    with using(device):
        return _train(folder, fields)


def compare(device: str, world_size: int, config, folder: str = SOLUTIONS) -> list:
    """Run every case on the CPU and on ``device`` ("cuda", or "cpu" to check this check); one Row each."""
    backend = "nccl" if device == "cuda" else "gloo"
    # debug=False: DDP's constructor crashes on the collective-checking process group (course/launch.py)
    on_cpu = dict(backend="gloo", device="cpu", debug=False)
    on_device = dict(backend=backend, device=device, debug=False)
    rows = []

    fields = asdict(config)
    alone = [_train_here(folder, fields, where) for where in ("cpu", "cuda:0" if device == "cuda" else "cpu")]
    rows.append(_training_row(folder, "1 MLP, one process", 1, config.amp, alone))

    reference = torch.matmul(*_matrices(*MATMUL_SHAPE))
    products = run(matmul_on_rank, world_size, folder, *MATMUL_SHAPE, **on_device)[0]
    difference = max(((C - reference).abs().max() / reference.abs().max()).item() for C in products)
    rows.append(Row("2 matmul, by row and by reduction", world_size, difference, 1e-5))

    def data_parallel(case, wrap_name, amp=False):
        fields_here = fields | {"amp": amp}
        results = [run(train_on_rank, world_size, folder, fields_here, wrap_name, **where)[0] for where in (on_cpu, on_device)]
        rows.append(_training_row(folder, case, world_size, amp, results))

    data_parallel("3 DDP", "ddp")
    data_parallel("3 DDP --amp", "ddp", amp=True)
    data_parallel("4 MyDP", "mydp")
    data_parallel("4 MyDP --amp", "mydp", amp=True)
    ring = run(ring_on_rank, world_size, folder, RING_LENGTH, **on_device)[0]
    exact = torch.arange(RING_LENGTH, dtype=torch.float32) * (world_size * (world_size + 1) // 2)
    rows.append(Row("5 ring all-reduce", world_size, (ring - exact).abs().max().item(), 0.0))
    data_parallel("6 OverlappedDP, 1 MiB buckets", "overlapped")
    return rows


def _training_row(folder: str, case: str, world_size: int, amp: bool, results: list) -> Row:
    cpu, other = results
    difference = impl.load(folder).mydp.largest_difference(cpu["state"], other["state"])
    return Row(case, world_size, difference, TOLERANCE[amp], (cpu["step_ms"], other["step_ms"]))


def report(rows: list, device_name: str) -> str:
    lines = [
        f"{'case':<36}{'world':>6}{'max |diff|':>12}{'limit':>9}{'CPU ms/step':>13}{device_name + ' ms/step':>16}  agree",
    ]
    for row in rows:
        times = f"{row.step_ms[0]:>13.2f}{row.step_ms[1]:>16.2f}" if row.step_ms else f"{'':>13}{'':>16}"
        lines.append(f"{row.case:<36}{row.world_size:>6}{row.difference:>12.2e}{row.tolerance:>9.0e}{times}  {'yes' if row.ok else 'NO'}")
    by_case = {row.case: row for row in rows}
    alone, ddp = by_case["1 MLP, one process"], by_case["3 DDP"]
    t_comp, t_step = alone.step_ms[1], ddp.step_ms[1]
    t_sync = max(t_step - t_comp, 0.0)
    lines.append(
        f"\nOn {device_name}: one process {t_comp:.2f} ms a step, DDP on {ddp.world_size} ranks {t_step:.2f} ms a step:"
        f" T_sync is about {t_sync:.2f} ms, T_sync/T_comp = {t_sync / t_comp:.2f}"
        f" (data parallelism pays when this is below R - 1 = {ddp.world_size - 1});"
        f" {ddp.world_size * t_comp / t_step:.2f}x the examples per second of one process."
    )
    agreed = sum(row.ok for row in rows)
    lines.append(f"{agreed} of {len(rows)} cases agree with the CPU." + ("" if agreed == len(rows) else " See the rows marked NO."))
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
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
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
