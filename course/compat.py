"""The range of torch the course supports (2.11 to 2.15), and `make compat TORCH=2.11.0`, which proves it.

    python -m course.compat --torch 2.11.0     # a side venv of that torch (cached), every exercise's checks
    python -m course.compat --torch 2.11.0 --ex 14 --scripts   # exercise 14's checks and the scripts only
    python -m course.compat --scripts          # the reference scripts in this environment (make demo)

Students keep the torch that requirements.txt pins; instructors on a cluster use the torch it has.
What differs across the range, and how the course handles it:

- torch 2.13 renamed the one-tensor collectives: dist.all_gather_into_tensor and
  dist.reduce_scatter_tensor became deprecated aliases of dist.all_gather_single and
  dist.reduce_scatter_single, which 2.11 and 2.12 lack. The handouts and the reference use the old
  names, which every version has; quiet_renamed_collectives() keeps 2.13's deprecation warning
  from telling students to use a name their cluster's torch may not have.
- Under them the process group's method differs too (_allgather_base and _reduce_scatter_base
  before 2.13, all_gather_single and reduce_scatter_single from 2.13): collective() names both by
  the function the handout names, so the checks recognise a collective by what it does.
- DTensor.full_tensor() on gloo needs the process group's allgather_into_tensor_coalesced, which
  2.11's gloo lacks: full_tensor() here gathers the local pieces with a plain all-gather instead.
  Under torch's collective check (DETAIL debug, as the checks run) 2.11 asks for it for any
  DTensor all-gather: cpu_mesh() puts torch's own DTensor code on a group the check leaves alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

OLDEST, NEWEST = "2.11.0", "2.15.0"
PINNED = "2.13.0"  # requirements.txt: what students install

# The process group's methods of the one-tensor collectives, by the torch.distributed function the
# handouts name.
_SAME_COLLECTIVE = {
    "all_gather_single": "all_gather_into_tensor",
    "_allgather_base": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
}


def collective(method: str) -> str:
    """A process group method's name as the checks report it: the handout's function for the
    one-tensor collectives, whichever torch runs; the method's own name for the others."""
    return _SAME_COLLECTIVE.get(method, method)


def quiet_renamed_collectives() -> None:
    """Silence torch 2.13's FutureWarning for dist.all_gather_into_tensor and dist.reduce_scatter_tensor
    in this process: the names the course teaches because every supported torch has them."""
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )


def cpu_mesh():
    """A one-dimensional CPU DeviceMesh of every rank, for torch's own DTensor code in the checks'
    probes, on a group that torch's collective check (DETAIL debug) leaves unwrapped: 2.11's wrapper
    turns DTensor's all-gather into allgather_into_tensor_coalesced, which 2.11's gloo lacks."""
    from torch.distributed.device_mesh import DeviceMesh

    from course.instrument import unchecked_group

    return DeviceMesh.from_group(unchecked_group(use="torch"), "cpu")


def full_tensor(piece):
    """A DTensor's whole value on every rank, as DTensor.full_tensor() gives it, on any supported torch.

    Only the placements the checks use: Replicate, or Shard(d) of torch.chunk's cut (uneven pieces
    allowed) on a one-dimensional mesh.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    local = piece.to_local()
    placement = piece.placements[0]
    if not isinstance(placement, Shard):
        return local
    group = piece.device_mesh.get_group()
    pieces = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, local.detach().cpu(), group=group)
    return torch.cat(pieces, dim=placement.dim).to(local.device)


# The reference scripts, as `make demo` runs them: each exercise file's main paths.
SCRIPTS = (
    "mlp.py --niters 300",
    "dist.py --world-size 3",
    "mlp.py --world-size 2 --niters 300 --check",
    "mydp.py --world-size 2 --niters 300 --compare",
    "data.py --world-size 3",
    "data.py --world-size 2 --uneven join",
    "sync.py --world-size 2",
    "zero.py --world-size 2 --niters 300",
    "zero.py --world-size 2 --niters 300 --bf16-hook",
    "hvd.py --world-size 2 --niters 300",
    "cost.py",
    "fsdp.py --world-size 2 --niters 50",
    "tp.py --world-size 2 --niters 300",
    "tp.py --world-size 2 --niters 300 --sequence-parallel",
    "pp.py --world-size 2 --schedule 1f1b --niters 300",
)


def venv_for(version: str, cache: str | None = None) -> str:
    """The Python of a side venv with torch==version (and what grading needs), made on first use and
    kept under ~/.cache/ddp-course/compat-VERSION: from PyPI, torch is a CUDA build of several GB."""
    folder = os.path.join(cache or os.path.expanduser("~/.cache/ddp-course"), f"compat-{version}")
    python = os.path.join(folder, "bin", "python")
    if _torch_version(python) == version:
        return python
    shutil.rmtree(folder, ignore_errors=True)  # a half-made venv from an install that was stopped
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", folder], check=True)
    # A pip configuration may cap torch (a machine's constraints file); the version asked for wins.
    env = dict(os.environ, PIP_CONSTRAINT=os.devnull)
    install = [python, "-m", "pip", "install", "-q", f"torch=={version}", "numpy", "pytest", "pytest-xdist"]
    subprocess.run(install, check=True, env=env)
    print(f"compat: made {folder} in {time.monotonic() - started:.0f} s")
    return python


def _torch_version(python: str) -> str | None:
    if not os.path.exists(python):
        return None
    asked = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return asked.stdout.strip().split("+")[0] if asked.returncode == 0 else None


def grade(python: str, exercise: int, implementation: str) -> tuple:
    """(score, most, seconds) of `python -m course grade --ex N` on the reference ("solutions") or the
    stubs ("student")."""
    from course.layout import ROOT

    with tempfile.TemporaryDirectory() as folder:
        results = os.path.join(folder, "results.json")
        started = time.monotonic()
        subprocess.run(
            [python, "-m", "course", "grade", "--ex", str(exercise), "--results", results],
            cwd=ROOT,
            env=dict(os.environ, COURSE_IMPL=implementation),
            capture_output=True,
        )
        seconds = time.monotonic() - started
        try:
            with open(results) as file:
                graded = json.load(file)
        except (OSError, ValueError):  # the grader did not start (torch does not import, say)
            return 0, 0, seconds
    return graded["score"], sum(test["max_score"] for test in graded["tests"]), seconds


def run_scripts(python: str, quiet: bool) -> list:
    """Run every reference script; (command, exit status, seconds, its output when quiet) each."""
    from course.layout import ROOT, SOLUTIONS

    ran = []
    for script in SCRIPTS:
        name, *flags = script.split()
        started = time.monotonic()
        # The course's own venv has the course installed; a side venv finds it on PYTHONPATH.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        command = [python, os.path.join(SOLUTIONS, name), *flags]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=quiet, text=True)
        ran.append((script, done.returncode, time.monotonic() - started, (done.stdout or "") + (done.stderr or "")))
        if done.returncode and not quiet:
            break
    return ran


def check(python: str, exercises: list | None = None, scripts: bool = True) -> bool:
    """Every exercise's checks (or those of `exercises`) on the reference (full marks) and on the stubs
    (0), then the reference scripts, under `python`; one line each. True when all are as they should be."""
    from course.layout import graded_exercises

    version = _torch_version(python)
    print(f"compat: torch {version}, {python}")
    good = True
    for exercise in graded_exercises() if exercises is None else exercises:
        score, most, seconds = grade(python, exercise, "solutions")
        stub_score, _, stub_seconds = grade(python, exercise, "student")
        ok = score == most > 0 and stub_score == 0
        good &= ok
        print(
            f"exercise {exercise:>2}: {'pass' if ok else 'FAIL'}  reference {score:g}/{most:g} ({seconds:.0f} s),"
            f" stubs {stub_score:g} ({stub_seconds:.0f} s)",
            flush=True,
        )
    for script, status, seconds, output in run_scripts(python, quiet=True) if scripts else []:
        good &= status == 0
        print(f"solutions/{script}: {'pass' if status == 0 else f'FAIL (exit {status})'} ({seconds:.0f} s)", flush=True)
        if status:
            print("\n".join("    " + line for line in output.strip().splitlines()[-15:]))
    print(f"compat: torch {version}: {'every exercise as it should be' if good else 'see the lines marked FAIL'}")
    return good


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course.compat", description=__doc__.splitlines()[0])
    parser.add_argument("--torch", metavar="VERSION", help=f"the torch to check, {OLDEST} to {NEWEST}")
    parser.add_argument("--scripts", action="store_true", help="only the reference scripts (alone: here, make demo)")
    parser.add_argument("--ex", type=int, action="append", help="only this exercise's checks (again for more)")
    args = parser.parse_args(argv)
    if args.scripts and not args.torch:
        return int(any(status for _, status, _, _ in run_scripts(sys.executable, quiet=False)))
    python = venv_for(args.torch) if args.torch else sys.executable
    exercises = [] if args.scripts and not args.ex else args.ex
    return 0 if check(python, exercises, scripts=args.scripts or not args.ex) else 1


if __name__ == "__main__":
    sys.exit(main())
