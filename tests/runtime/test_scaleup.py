"""The instructors' scale-up path: the same scripts under torchrun, srun and mpiexec, on GPUs, with --amp."""

import contextlib
import os
import re
import runpy
import signal
import socket
import sys
import time
import traceback
import types
from unittest import mock

import pytest
import torch
import torch._dynamo  # noqa: F401 - every optimizer imports it (seconds): the forked ranks below inherit it
import torch.distributed as dist

from checks.comm_log import CommLog
from checks.helpers import small_config, world
from course import impl
from course.device import amp_dtype, bound_device, current_device, ddp_device_ids
from course.instructors import gpu_check
from course.instructors.student import SOLUTIONS
from course.launch import launch, run
from course.runtime import env
from tests.mutants import make_mutant, plant
from tests.runtime.test_launch import descendants, rank_sum

# A script's own work takes a fraction of a second at these sizes: starting processes dominates.
TINY = ["--niters", "20", "--dim-in", "32", "--dim-hidden", "32", "--train-size", "1000"]
SCRIPT = {name: os.path.join(SOLUTIONS, f"{name}.py") for name in ("mlp", "dist", "mydp", "hvd")}
no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


# --- processes started the way a launcher starts them ---------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(name, *argv):
    """What `python solutions/NAME.py ARGV... --device cpu` runs; a clean exit returns.

    On the CPU: these run in forked copies of the test process, and CUDA cannot be used in a
    copy forked after its parent used it (the GPU tests below do, on a machine with a GPU).
    """
    sys.argv = [SCRIPT[name], *argv, "--device", "cpu"]
    sys.path.insert(0, SOLUTIONS)  # what python does for a script: mydp.py imports mlp
    try:
        runpy.run_path(SCRIPT[name], run_name="__main__")
    except SystemExit as stop:
        if stop.code:
            raise


def script(name, *argv):
    return lambda: run_script(name, *argv)


def torchrun(*argv):
    """The entry point of the `torchrun ARGV...` command, as a function."""

    def main():
        from torch.distributed.run import main as torchrun_main

        torchrun_main(list(argv))

    return main


def torchrun_forked_workers(name, *argv):
    """torchrun's own agent, rendezvous and variables for 2 workers, each a forked copy of this process.

    `torchrun script.py` starts fresh interpreters: 2 s of CPU each to import torch, and 2 s more
    to import torch._dynamo in a script that trains (its first optimizer does). Forked workers
    skip only that.
    """

    def main():
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=2,
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",
            run_id=name,
            max_restarts=0,
            start_method="fork",
        )
        elastic_launch(config, run_script)(name, *argv)

    return main


def _forked(main, variables, log):
    """Run main() in a forked copy of this process with extra environment variables, output to log.

    torch is imported here already, so the copy starts in milliseconds where a fresh interpreter
    spends seconds importing it; what it runs is the launcher's or the script's own entry point.
    """
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(out, 2)
        sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)  # not pytest's capture
        os.environ.update(variables)
        main()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:  # noqa: BLE001 - the log must say what went wrong
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        os._exit(code)


def processes(tmp_path, *started, seconds=60):
    """Start every (main, variables) pair at once; return [(exit code, output)] in the same order.

    Whatever is still running after `seconds` is killed with everything it started.
    """
    logs = [str(tmp_path / f"process{i}.log") for i in range(len(started))]
    pids = [_forked(main, variables, log) for (main, variables), log in zip(started, logs)]
    codes, deadline = {}, time.monotonic() + seconds
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in set(pids) - set(codes):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    stuck = [pid for pid in pids if pid not in codes]
    for pid in stuck:
        for p in descendants(pid) + [pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        os.waitpid(pid, 0)
    outputs = []
    for log in logs:
        with open(log) as f:
            outputs.append(f.read())
    assert not stuck, f"still running after {seconds} s:\n" + "\n---\n".join(outputs)
    return [(codes[pid], out) for pid, out in zip(pids, outputs)]


# --- what each script prints when it ran as one world of two ranks ---------------------------


def check_mlp_output(code, out, launcher):
    assert code == 0, out
    # Two 'final' lines would mean each process trained alone (the world-size-1 shortcut).
    assert out.count("final |") == 1 and "parameters close across ranks: True" in out, out
    assert f"note: {launcher} started 2 ranks; --world-size 1 does not apply" in out, out


def check_dist_output(code, out):
    assert code == 0, out
    assert "My rank is 0, same as 0" in out and "My rank is 1, same as 1" in out, out
    assert out.count("by row: matches") == 1 and out.count("by reduction: matches") == 1, out


def check_mydp_output(code, out):
    assert code == 0, out
    assert out.count("final |") == 1, out
    gap = float(re.search(r"between MyDP and built-in DDP: (\S+)", out).group(1))
    assert gap < 1e-5, out


def test_dist_accepts_a_large_product_rounded_in_float32(tmp_path):
    """`dist.py --shape 100 3000 100`: sums of 3000 terms round more than 1e-5 away from A @ B, correctly."""
    shape = (100, 3000, 100)
    by_row, by_reduction = run(gpu_check.matmul_on_rank, 2, SOLUTIONS, *shape)[0]
    rounding = (by_reduction - torch.matmul(*gpu_check.matrices(*shape))).abs().max().item()
    assert rounding > 1e-5, (
        f"this shape no longer shows float32 rounding beyond 1e-5 ({rounding:.1e}): choose a larger k"
    )
    [(code, out)] = processes(tmp_path, (script("dist", "--world-size", "2", "--shape", *map(str, shape)), {}))
    check_dist_output(code, out)


def test_torchrun_runs_each_script(tmp_path):
    """`torchrun --nproc-per-node=2 solutions/X.py`: each script joins torchrun's world of 2.

    dist.py runs in fresh interpreters, exactly as the command starts it. mlp.py and mydp.py run
    in forked workers under the same agent: the suite's time allows one set of fresh workers,
    and dist.py's are the cheapest (no optimizer, so no torch._dynamo).
    """
    ranks = ["--standalone", "--nproc-per-node=2"]  # --standalone: torchrun picks a free port
    (mlp, dist_, mydp) = processes(
        tmp_path,
        (torchrun_forked_workers("mlp", *TINY), {}),
        (torchrun(*ranks, SCRIPT["dist"]), {}),
        (torchrun_forked_workers("mydp", "--world-size", "2", "--compare", *TINY), {}),
    )
    check_mlp_output(*mlp, "torchrun")
    check_dist_output(*dist_)
    check_mydp_output(*mydp)


def mpi_variables(rank, kind):
    names = {
        "openmpi": (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
        "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    }[kind]
    return dict(zip(names, (str(rank), "2", str(rank), "2")))


def test_mpiexec_openmpi_ranks_join(tmp_path):
    """`mpiexec -n 2 python solutions/dist.py` with OpenMPI: rank and size from OMPI_COMM_WORLD_*."""
    port = str(free_port())
    rank0, rank1 = processes(
        tmp_path,
        *[
            (script("dist"), mpi_variables(r, "openmpi") | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
            for r in (0, 1)
        ],
    )
    check_dist_output(rank0[0], rank0[1] + rank1[1])
    assert rank1[0] == 0 and "matches" not in rank1[1], "only rank 0 should go on after launch()"


def test_mpiexec_mpich_ranks_join(tmp_path):
    """MPICH/Intel MPI's PMI_* variables; no MASTER_ADDR (all ranks here), the port from --port."""
    port = str(free_port())
    rank0, rank1 = processes(
        tmp_path, *[(script("mlp", *TINY, "--port", port), mpi_variables(r, "mpich")) for r in (0, 1)]
    )
    check_mlp_output(*rank0, "mpich")
    assert rank1[0] == 0 and "final |" not in rank1[1], rank1[1]


def test_mpiexec_runs_the_horovod_style_script(tmp_path):
    """`mpiexec -n 2 python solutions/hvd.py`, as Horovod's scripts run: OpenMPI's variables, the port from --port."""
    port = str(free_port())
    rank0, rank1 = processes(
        tmp_path, *[(script("hvd", *TINY, "--port", port), mpi_variables(r, "openmpi")) for r in (0, 1)]
    )
    check_mlp_output(*rank0, "openmpi")
    assert rank1[0] == 0 and "final |" not in rank1[1], rank1[1]


def test_srun_ranks_on_two_nodes_join(tmp_path):
    """`srun` tasks, each local rank 0 as on two nodes, meeting on the step's first node."""
    port = str(free_port())
    variables = {
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "localhost",
        "MASTER_PORT": port,
    }
    rank0, rank1 = processes(
        tmp_path, *[(script("mydp", "--compare", *TINY), variables | {"SLURM_PROCID": str(r)}) for r in (0, 1)]
    )
    check_mydp_output(*rank0)
    assert rank1 == (0, ""), rank1[1]


def test_srun_with_pmi2_ranks_join_as_slurm(tmp_path):
    """`srun --mpi=pmi2`: SLURM's pmi2 plugin adds PMI_RANK and PMI_SIZE, which MPICH sets too."""
    port = str(free_port())
    variables = {
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "localhost",
        "MASTER_PORT": port,
        "PMI_SIZE": "2",
        "PMI_JOBID": "4242.0",
    }
    rank0, rank1 = processes(
        tmp_path, *[(script("dist"), variables | {"SLURM_PROCID": str(r), "PMI_RANK": str(r)}) for r in (0, 1)]
    )
    check_dist_output(rank0[0], rank0[1] + rank1[1])
    assert rank1[0] == 0 and "matches" not in rank1[1], rank1[1]


# --- course/runtime/env.py: which world, where to meet, which device ---------------------------------


def test_launcher_detection():
    assert env.external_world({}) is None
    torchrun_vars = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert env.external_world(torchrun_vars) == env.ExternalWorld("torchrun", 3, 8, 1, 2)
    ompi = {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_SIZE": "6",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
    }
    assert env.external_world(ompi) == env.ExternalWorld("openmpi", 5, 6, 2, 3)
    mpich = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    assert env.external_world(mpich) == env.ExternalWorld("mpich", 1, 4, 1, 2)
    srun = {"SLURM_PROCID": "7", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "3", "SLURM_NTASKS": "8"}
    assert env.external_world(srun) == env.ExternalWorld("slurm", 7, 8, 3, None)
    sbatch_script = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "gpu[1-2]"}
    assert env.external_world(sbatch_script) is None, "an sbatch script outside srun starts its own world"
    mpiexec_in_slurm_job = ompi | {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0"}
    assert env.external_world(mpiexec_in_slurm_job).launcher == "openmpi"
    srun_pmi2 = srun | {"PMI_RANK": "7", "PMI_SIZE": "8", "PMI_FD": "5", "PMI_JOBID": "4242.0"}
    assert env.external_world(srun_pmi2) == env.ExternalWorld("slurm", 7, 8, 3, None), (
        "pmi2 sets PMI_* but is not MPICH"
    )
    hydra_in_slurm_job = mpich | {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0"}
    assert env.external_world(hydra_in_slurm_job) == env.ExternalWorld("mpich", 1, 4, 1, 2)


def test_first_host_of_slurm_node_lists():
    assert env.first_host("gpu07") == "gpu07"
    assert env.first_host("gpu[07-09,12],cpu01") == "gpu07"
    assert env.first_host("a01,gpu[3-4]") == "a01"
    assert env.first_host("rack[2-3]-n[5,9]") == "rack2-n5"


def test_rendezvous():
    srun = env.ExternalWorld("slurm", 1, 4, 1, None)
    assert env.rendezvous(srun, {"SLURM_STEP_NODELIST": "gpu[3-4]"}) == ("gpu3", env.DEFAULT_PORT)
    assert env.rendezvous(srun, {"SLURM_STEP_NODELIST": "gpu[3-4]", "MASTER_ADDR": "head", "MASTER_PORT": "1234"}) == (
        "head",
        1234,
    )
    assert env.rendezvous(srun, {"MASTER_ADDR": "head", "MASTER_PORT": "1234"}, "other", 99) == ("other", 99), (
        "flags win"
    )
    one_machine = env.ExternalWorld("openmpi", 0, 2, 0, 2)
    assert env.rendezvous(one_machine, {}, port=99) == ("127.0.0.1", 99)
    with pytest.raises(ValueError, match="--master-addr"):
        env.rendezvous(env.ExternalWorld("mpich", 0, 4, 0, 2), {})
    torchrun_world = env.ExternalWorld("torchrun", 0, 2, 0, 2)
    agent = {"MASTER_ADDR": "node1", "MASTER_PORT": "29400"}
    assert env.rendezvous(torchrun_world, agent, "other", 99) == ("node1", 29400), "torchrun's own store wins"


def test_device_and_backend_choice():
    choose = env.choose_device
    assert choose(None, None, 0, gpus=0, ranks_here=2) == "cpu"
    assert choose(None, None, 1, gpus=2, ranks_here=2) == "cuda:1"
    assert choose(None, None, 1, gpus=1, ranks_here=2) == "cpu", "two ranks cannot share one GPU with nccl"
    assert choose(None, None, 3, gpus=1, ranks_here=None) == "cuda:0", "srun --gpus-per-task=1 shows each rank its own"
    assert choose(None, "gloo", 0, gpus=4, ranks_here=1) == "cpu"
    assert choose("cuda:2", None, 0, gpus=4, ranks_here=1) == "cuda:2"
    assert choose("cpu", None, 0, gpus=4, ranks_here=1) == "cpu"
    with pytest.raises(ValueError, match="no GPU"):
        choose("cuda", None, 0, gpus=0, ranks_here=1)
    with pytest.raises(ValueError, match="local rank 2"):
        choose(None, "nccl", 2, gpus=2, ranks_here=4)
    with pytest.raises(ValueError, match="NCCL needs one per rank; start at most 1 rank"):
        choose(None, "nccl", 1, gpus=1, ranks_here=2, same_gpus=True)
    assert choose("cuda", "gloo", 1, gpus=1, ranks_here=2, same_gpus=True) == "cuda:0", "gloo lets ranks share a GPU"
    assert choose("cuda", "gloo", 3, gpus=2, ranks_here=4, same_gpus=True) == "cuda:1"
    assert env.choose_backend(None, "cuda:0") == "nccl" and env.choose_backend(None, "cpu") == "gloo"
    assert env.choose_backend("gloo", "cuda:0") == "gloo"
    with pytest.raises(ValueError, match="GPU tensors only"):
        env.choose_backend("nccl", "cpu")


def test_device_accessors_on_cpu(monkeypatch):
    assert current_device() == torch.device("cpu")
    assert ddp_device_ids(torch.nn.Linear(2, 2)) is None
    assert amp_dtype(torch.device("cpu")) == torch.bfloat16
    assert bound_device("gloo") is None
    monkeypatch.setenv("COURSE_DEVICE", "cuda:1")  # what select("cuda:1") records, without a GPU
    assert bound_device("nccl") == torch.device("cuda:1"), "NCCL should set up its communicator at init_process_group"


@pytest.mark.parametrize("major, expected", [(7, torch.float16), (8, torch.bfloat16), (9, torch.bfloat16)])
def test_amp_type_follows_the_gpu_generation(monkeypatch, major, expected):
    """float16 and loss scaling before Ampere (compute capability 8), even though V100 and T4 emulate bfloat16."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(major=major))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)  # emulation works
    assert amp_dtype(torch.device("cuda:0")) == expected


def test_two_nccl_ranks_on_one_gpu_stop_with_one_line(monkeypatch, capsys):
    """Both ranks would take cuda:0, and NCCL would end the world with "Duplicate GPU detected"."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as stop:
        launch(rank_sum, 2, backend="nccl")
    assert stop.value.code == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and said.startswith("Cannot start: the rank with local rank 1 has no GPU of its own")
    assert "--world-size 1" in said and "--backend gloo" in said


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_impossible_setting_stops_with_its_reason(capsys):
    with pytest.raises(SystemExit) as stop:
        launch(rank_sum, 2, backend="nccl")
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("Cannot start: no GPU is visible here")


# --- mixed precision --------------------------------------------------------------------------


def train_both_with(folder, changes):
    ex = impl.load(folder)
    return ex.mydp.train_both(small_config(ex.mlp, **changes), False)


def check_amp(folder):
    """--amp: DDP and MyDP agree, and 2 ranks of 8 rows match one process of 16 within bf16 rounding."""
    ex = impl.load(folder)
    difference = ex.mydp.largest_difference
    mine, builtin = world(train_both_with, 2, folder, {"amp": True}, expect=object)[0]
    alone = ex.mlp.train(small_config(ex.mlp, batch_size=16, amp=True))
    full = ex.mlp.train(small_config(ex.mlp, batch_size=16))
    assert difference(mine["state"], builtin["state"]) < 1e-5, (
        "with --amp, MyDP and built-in DDP should take the same steps"
    )
    # bfloat16 keeps 8 bits of mantissa: parameters near 0.3 round to steps of about 1e-3.
    assert difference(mine["state"], alone["state"]) < 2e-3, (
        "with --amp, 2 ranks should train like one process on both batches"
    )
    assert difference(alone["state"], full["state"]) > 1e-5, "--amp changed nothing: is autocast on?"


def test_amp_data_parallel_matches_one_process():
    check_amp(SOLUTIONS)


# --- the ring on NCCL ------------------------------------------------------------------------


def messages_outside_batches(folder, length):
    """Worker: ring_all_reduce; how many messages it started, and which not inside dist.batch_isend_irecv."""
    batch = dist.batch_isend_irecv

    def marked(ops):
        log.mark("batch")
        works = batch(ops)
        log.mark("end")
        return works

    with CommLog() as log, mock.patch.object(dist, "batch_isend_irecv", marked):
        impl.load(folder).dist.ring_all_reduce(torch.arange(length, dtype=torch.float32))
    inside, outside = False, []
    for event in log.events:
        if event.kind == "mark":
            inside = event.what == "batch"
        elif not inside and event.kind == "start":
            outside.append(event.what)
    return len(log.started()), outside


def test_reference_ring_batches_its_messages():
    """NCCL hangs on a send and a receive started one by one (exercises/05_ring.md); gloo cannot show the hang."""
    for started, outside in run(messages_outside_batches, 3, SOLUTIONS, 10):
        assert started == 8 and outside == [], f"{started} messages, started outside a batch: {outside}"


# --- make gpu-check ---------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_check_without_gpu_says_so(capsys):
    assert gpu_check.main([]) == 0
    assert "no GPU here" in capsys.readouterr().out


def test_gpu_check_compares_every_case():
    """The check itself, run with the CPU standing in for the GPU: every case, and a report."""
    rows = gpu_check.compare("cpu", 2, small_config(impl.load(SOLUTIONS).mlp))
    assert [row.case for row in rows] == [
        "1 MLP, one process",
        "2 matmul, by row and by reduction",
        "3 DDP",
        "3 DDP --amp",
        "4 MyDP",
        "4 MyDP --amp",
        "5 ring all-reduce",
        "6 OverlappedDP, 1 MiB buckets",
        "13 ZeRO-2 and ZeRO-3 (final test loss)",
        "13 ZeRO-3, bfloat16 gathers (final test loss)",
        "14 tensor parallel (final loss)",
        "14 sequence parallel (final loss)",
        "15 pipeline, 1F1B",
        "16 data x tensor parallel mesh (final loss)",
        "18 expert parallel, dp x ep mesh (final loss)",
    ]
    assert all(row.ok for row in rows), gpu_check.report(rows, "CPU")
    assert "15 of 15 cases agree with the CPU." in gpu_check.report(rows, "CPU")
    assert "COURSE_DEVICE" not in os.environ, "the check should leave this process's device as it found it"
    assert torch.backends.cuda.matmul.fp32_precision == "none", "and its float32 precision"


def test_gpu_check_keeps_the_table_when_a_case_fails(tmp_path):
    """A ring that raises on rank 1: its row says so, with rank 1's error below the table, and case 6 still runs."""
    folder = make_mutant(
        tmp_path,
        "dist.py",
        "    for step in range(world_size - 1):\n        # The chunk sent on",
        "    if rank == 1:\n        raise RuntimeError('lost the ring')\n"
        "    for step in range(world_size - 1):\n        # The chunk sent on",
    )
    # The cases around it only: every case's agreement is test_gpu_check_compares_every_case's.
    rows = gpu_check.compare("cpu", 2, small_config(impl.load(SOLUTIONS).mlp), folder, exercises={4, 5, 6})
    failed = [row.case for row in rows if not row.ok]
    assert failed == ["5 ring all-reduce"] and len(rows) == 4, gpu_check.report(rows, "CPU")
    text = gpu_check.report(rows, "CPU")
    assert "failed, see below" in text and "lost the ring" in text and "rank 1" in text, text
    assert "3 of 4 cases agree with the CPU." in text, text


def planted(dest, mistakes: list) -> str:
    """The reference in dest with each mistake (file, old, new) made; return dest."""
    make_mutant(dest, *mistakes[0])
    for mistake in mistakes[1:]:
        plant(dest, *mistake)
    return str(dest)


LAYERS = "        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(sizes, sizes[1:]))\n"
# A mistake in each exercise's own code, none of which mlp.train runs.
OWN_MISTAKES = [
    (  # C's row blocks gathered in the wrong order
        "dist.py",
        "    return torch.cat([piece[:size] for piece, size in zip(pieces, rows)])\n",
        "    return torch.cat([piece[:size] for piece, size in zip(pieces[::-1], rows)])\n",
    ),
    ("dist.py", "        chunks[recv].add_(incoming)\n", "        chunks[recv].copy_(incoming)\n"),
    ("mydp.py", "        mean = grad / dist.get_world_size()\n", "        mean = grad.clone()\n"),  # no 1/W
    ("mydp.py", "        bucket.buffer.div_(dist.get_world_size())\n", ""),
    (  # each rank keeps the other's piece. (No 1/W would not show: Adam's step ignores the scale.)
        "fsdp.py",
        "    return padded.chunk(world_size)[rank].clone()\n",
        "    return padded.chunk(world_size)[world_size - 1 - rank].clone()\n",
    ),
    (  # Copy's backward sums nothing
        "tp.py",
        "        total = grad.clone(memory_format=torch.contiguous_format)\n        dist.all_reduce(total)\n",
        "        total = grad.clone(memory_format=torch.contiguous_format)\n",
    ),
    (  # nor AllReduce's forward
        "tp.py",
        "        total = x.clone(memory_format=torch.contiguous_format)\n        dist.all_reduce(total)\n",
        "        total = x.clone(memory_format=torch.contiguous_format)\n",
    ),
    ("pp.py", "    return F.cross_entropy(logits, targets) / m\n", "    return F.cross_entropy(logits, targets)\n"),
    (  # the mesh's Copy sums nothing in its tp group
        "nd.py",
        "        total = grad.clone(memory_format=torch.contiguous_format)\n        dist.all_reduce(total, group=ctx.group)\n",
        "        total = grad.clone(memory_format=torch.contiguous_format)\n",
    ),
    ("moe.py", "        p.grad /= world_size\n", ""),  # gradients summed, not averaged
]


def test_gpu_check_rows_are_stable_under_a_nudge(tmp_path):
    """Initial weights 1e-7 apart on the two sides: every row still agrees. A row whose training is
    chaotic (exercise 13's Adam at 0.1 was) would turn a rounding difference into a failure."""
    nudge = "        with torch.no_grad():\n            for layer in self.layers:\n                layer.weight.add_(1e-7)\n"
    folder = make_mutant(tmp_path, "mlp.py", LAYERS, LAYERS + nudge)
    # Exercise 18's model is its own: nudged too, where a top-k choice or a dropped token could turn on a rounding.
    built = "    full = MoEModel(config, ep * per_rank).to(device)\n"
    plant(
        folder,
        "moe.py",
        built,
        built + "    with torch.no_grad():\n        for p in full.parameters():\n            p.add_(1e-7)\n",
    )
    rows = gpu_check.compare("cpu", 2, small_config(impl.load(SOLUTIONS).mlp), folder, reference=SOLUTIONS)
    assert all(row.ok for row in rows), gpu_check.report(rows, "nudged CPU")


def test_every_gpu_check_row_fails_on_a_planted_mistake(tmp_path):
    """Mistakes on one side only, as a GPU-only bug would be: mlp.py's learning rate halved fails
    exercise 1's and 3's rows (built-in DDP: none of the course's code but mlp.py's); a mistake in
    each other exercise's own code fails its rows."""
    config = small_config(impl.load(SOLUTIONS).mlp)
    halved = planted(tmp_path / "lr", [("mlp.py", "lr=config.lr)", "lr=config.lr / 2)")])
    rows = gpu_check.compare("cpu", 2, config, halved, reference=SOLUTIONS, exercises={1, 3})
    assert len(rows) == 3 and not any(row.ok for row in rows), gpu_check.report(rows, "CPU, learning rate halved")
    own = planted(tmp_path / "own", OWN_MISTAKES)
    rows = gpu_check.compare("cpu", 2, config, own, reference=SOLUTIONS, exercises=gpu_check.MULTI_RANK - {3})
    assert len(rows) == 12 and not any(row.ok for row in rows), gpu_check.report(rows, "CPU, mistakes planted")


def test_data_parallel_sentences_hold_for_any_world_size():
    one = gpu_check.data_parallel_pays("GPU", 1.0, 1.2, 1)
    assert "R - 1 = 0" not in one and "one rank nothing is shared" in one, one
    two = gpu_check.data_parallel_pays("GPU", 1.0, 1.25, 2)
    assert "1.60x" in two and "below R - 1 = 1, and does here" in two, two
    assert "does not here" in gpu_check.data_parallel_pays("GPU", 1.0, 2.5, 2)


def test_gpu_check_size_line():
    """The larger size's line, the CPU standing in for the GPU at a size this machine runs in a second."""
    config = small_config(impl.load(SOLUTIONS).mlp)
    line = gpu_check.size_up("cpu", config, {"d_hidden": 64}, {"cpu": 2, "device": 3})
    assert re.fullmatch(
        r"At d_hidden 64: one process on the CPU [\d.]+ ms a step \(2 steps\), on cpu [\d.]+ ms a step \(3 steps\): \d+x\.",
        line,
    ), line


def test_ieee_float32_pins_and_restores():
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # as a user or a site may have set it
    try:
        with gpu_check.ieee_float32():
            assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = "none"


# --- on GPUs (skipped without one) ------------------------------------------------------------


def device_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)], device=current_device())
    dist.all_reduce(t)
    return str(current_device()), t.item()


@no_gpu
def test_nccl_world_one_rank_per_gpu():
    ranks = min(2, torch.cuda.device_count())
    results = run(device_and_sum, ranks, backend="nccl", device="cuda")
    assert results == [(f"cuda:{r}", ranks * (ranks + 1) / 2) for r in range(ranks)]


@no_gpu
def test_gpu_check_agrees_on_gpus():
    rows = gpu_check.compare("cuda", torch.cuda.device_count(), small_config(impl.load(SOLUTIONS).mlp))
    assert all(row.ok for row in rows), gpu_check.report(rows, "GPU")
