"""The kernel's count of torch's entries (course/runtime/uprobes.py): every path to them, in every thread and
process a call starts, in a kept world and in one whose calls are forked afresh (for credit); a count no code
of the call can write."""

import errno
import os
import platform
import subprocess
import sys
import tempfile
import threading

import pytest
import torch
import torch.distributed as dist

from course.launch import run
from course.runtime import sandbox, uprobes
from tests.runtime.test_kept_worlds import no_kept_world  # noqa: F401 - each test starts with no kept world

pytestmark = pytest.mark.skipif(not uprobes.available(), reason="the kernel counts no calls for this process here")


def nothing():
    return 0


def plain_all_reduce():
    dist.all_reduce(torch.ones(3))
    return 0


def functional_all_reduce():
    import torch.distributed._functional_collectives as funcol

    funcol.wait_tensor(funcol.all_reduce(torch.ones(3), "sum", dist.group.WORLD))
    return 0


def ddp_in_a_thread():
    """torch's DDP made by a thread the call starts: the thread inherits the count."""
    made = threading.Thread(target=torch.nn.parallel.DistributedDataParallel, args=(torch.nn.Linear(2, 2),))
    made.start()
    made.join()
    return 0


def ddp_in_a_child():
    """torch's DDP made by a process the call forks, in a group of its own: its count reaches the rank's when it ends."""
    child = os.fork()
    if child == 0:  # the world's group is its parent's: one of its own, alone
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        os._exit(0)
    os.waitpid(child, 0)
    return 0


@pytest.mark.parametrize("fresh", [False, True], ids=["kept", "fresh"])
def test_every_path_to_an_entry_is_counted_on_each_rank(fresh):
    """Each call's count is its own: the calls before it in the same world are not in it."""
    ways = [
        (nothing, {}),
        (plain_all_reduce, {"collective": 1}),
        (functional_all_reduce, {"collective": 1}),
        (nothing, {}),
    ]
    for fn, expected in ways:
        calls = run(fn, 2, keep=True, fresh=fresh, observe=True, count_calls=True).calls
        assert calls == {(r, name): expected.get(name, 0) for r in range(2) for name in uprobes.ENTRIES}, fn


def test_a_kept_world_counts_what_each_call_names():
    """A world counts only the entries its calls forbid (an event per thread each), and one a later call names
    from that call on, once: events added on the threads an earlier call left are not counted twice."""
    first = run(plain_all_reduce, 2, keep=True, observe=True, count_calls=("DistributedDataParallel",)).calls
    assert first == {(r, "DistributedDataParallel"): 0 for r in range(2)}, first
    for names in [("collective",), ("collective", "DistributedDataParallel")]:
        calls = run(plain_all_reduce, 2, keep=True, observe=True, count_calls=names).calls
        assert {key: n for key, n in calls.items() if key[1] == "collective"} == {
            (0, "collective"): 1,
            (1, "collective"): 1,
        }, calls


def dtensor_made(how):
    """Probe: a DTensor used as `how` says, on a mesh of the world: made by DTensor.from_local, by distribute_tensor,
    by torch's fully_shard and parallelize_module (their parameters), or past its constructor (a wrapper of its
    class made by hand, as no code of torch's does: its first operation enters DTensor's dispatch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    local = torch.ones(2, 2)
    if how == "from_local":
        DTensor.from_local(local, mesh, [Shard(0)])
    elif how == "distribute_tensor":
        distribute_tensor(local, mesh, [Replicate()])
    elif how == "fully_shard":
        fully_shard(torch.nn.Linear(2, 2), mesh=mesh)
    elif how == "parallelize_module":
        parallelize_module(torch.nn.Sequential(torch.nn.Linear(2, 2)), mesh, {"0": ColwiseParallel()})
    else:
        made = torch.Tensor._make_wrapper_subclass(DTensor, local.shape, strides=local.stride(), dtype=local.dtype)
        made._spec = DTensorSpec(mesh, (Replicate(),), TensorMeta(local.shape, local.stride(), local.dtype))
        made._local_tensor = local
        (made + made).to_local()
    return 0


@pytest.mark.parametrize("how", ["from_local", "distribute_tensor", "fully_shard", "parallelize_module", "wrapper"])
def test_every_way_to_a_dtensor_is_counted(how):
    """Exercises 13, 14 and 16 forbid DTensor: torch's fully_shard and parallelize_module make their parameters so."""
    calls = run(dtensor_made, 2, how, keep=True, observe=True, count_calls=("DTensor",)).calls
    assert all(calls[(r, "DTensor")] > 0 for r in range(2)), calls


def ddp_in_a_new_interpreter():
    """torch's DDP made by a Python the call starts afresh (fork, then exec): the kernel keeps counting across exec."""
    made = "torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))"
    join = "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)"
    subprocess.run([sys.executable, "-c", f"import torch, torch.distributed as dist; {join}; {made}"], check=True)
    return 0


@pytest.mark.parametrize("fn", [ddp_in_a_thread, ddp_in_a_child])
@pytest.mark.parametrize("fresh", [False, True], ids=["kept", "fresh"])
def test_what_a_call_starts_is_counted(fn, fresh):
    calls = run(fn, 2, keep=True, fresh=fresh, observe=True, count_calls=True).calls
    assert [calls[(r, "DistributedDataParallel")] for r in range(2)] == [1, 1], calls


def test_a_new_interpreter_is_counted():
    calls = run(ddp_in_a_new_interpreter, 1, keep=True, fresh=True, observe=True, count_calls=True).calls
    assert calls[(0, "DistributedDataParallel")] == 1, calls


def pipelining_imported_by(how):
    """Probe: torch.distributed.pipelining imported (a part written in Python only) in this process, a thread it
    starts, a process it forks, or a Python it starts afresh."""
    load = "import torch.distributed.pipelining"
    if how == "thread":
        thread = threading.Thread(target=exec, args=(load,))
        thread.start()
        thread.join()
    elif how == "fork":
        child = os.fork()
        if child == 0:
            exec(load)
            os._exit(0)
        os.waitpid(child, 0)
    elif how == "exec":
        subprocess.run([sys.executable, "-c", load], check=True)
    elif how in ("into its folder", "from the folder above"):  # its source read by a name the filter cannot see
        folder = os.path.join(os.path.dirname(torch.__file__), "distributed")
        inside = how == "into its folder"
        here = os.getcwd()
        os.chdir(os.path.join(folder, "pipelining") if inside else folder)
        try:
            with open("schedules.py" if inside else os.path.join("pipelining", "schedules.py")) as f:
                f.read()
        finally:
            os.chdir(here)
    elif how == "by a long path":  # its name past the 1024 bytes of a path that the kernel's filter reads
        padded = "/" + "./" * 600 + os.path.join(os.path.dirname(torch.__file__), "distributed", "pipelining")
        with open(os.path.join(padded, "schedules.py")) as f:
            f.read()
    elif how == "by a link":
        link = os.path.join(tempfile.mkdtemp(), "p")
        os.symlink(os.path.join(os.path.dirname(torch.__file__), "distributed", "pipelining"), link)
        with open(os.path.join(link, "schedules.py")) as f:
            f.read()
    else:
        exec(load)
    return 0


HOWS = ["process", "thread", "fork", "exec", "into its folder", "from the folder above", "by a long path", "by a link"]


@pytest.mark.parametrize("how", HOWS)
def test_a_part_in_python_only_is_counted_by_the_calls_naming_its_files(how):
    """Where the part comes from: its files, which the ranks open when they import it (no rank holds it before), on
    every path, by any name; none in a call that names them not, nor of another part's."""
    calls = run(pipelining_imported_by, 2, how, keep=True, fresh=True, observe=True, count_calls=True).calls
    assert all(calls[(r, "pipelining")] > 0 for r in range(2)), calls
    # A path too long for the filter to read is every such part's: which one it names, the kernel cannot tell.
    others = [
        n for n in uprobes.ENTRIES if n != "pipelining" and not (how == "by a long path" and uprobes.ENTRIES[n].paths)
    ]
    assert not any(count for (_, name), count in calls.items() if name in others), calls


def test_a_part_this_process_holds_is_not_said_to_be_counted():
    """A rank forked from a process that holds the part uses it without opening a file: available() says no."""
    assert uprobes.available(("pipelining",))
    child = os.fork()
    if child == 0:
        import torch.distributed.pipelining  # noqa: F401

        os._exit(0 if not uprobes.available(("pipelining",)) and uprobes.available(("collective",)) else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0


def test_a_reference_world_is_not_counted():
    """A reference world runs torch's own on purpose (a judge's DDP): it is neither counted nor judged."""
    assert run(plain_all_reduce, 2, keep=True, reference=True, observe=True, count_calls=True).calls is None


def test_the_counts_leave_the_descriptors_that_select_takes():
    """A grader holds an event per thread and function of every kept world (hundreds): above FD_SETSIZE, where its
    pipes and sockets, which select() watches, are not pushed (run 33 of issue 49: 96 tests failed without it)."""
    run(nothing, 4, keep=True, observe=True, count_calls=True)
    events = [int(fd) for fd in os.listdir("/proc/self/fd") if _is_an_event(fd)]
    assert len(events) > 16 and min(events) >= uprobes._HIGH, sorted(events)


def _is_an_event(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[perf_event]"
    except OSError:  # closed since it was listed
        return False


def io_uring_setup():
    """Probe: the errno of io_uring_setup, 0 where it gave a ring (closed at once)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ring = libc.syscall(425, 1, ctypes.create_string_buffer(120))  # x86-64's and arm64's number
    if ring < 0:
        return ctypes.get_errno()
    os.close(ring)
    return 0


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="the filter knows these two")
def test_a_sandboxed_rank_sets_up_no_io_uring():
    """An io_uring's requests, an open among them, pass no system call's tracepoint: a rank may not make one (the
    sandbox's seccomp filter, at each level; without a sandbox it may, the control, where the kernel allows it)."""
    if sandbox.level().name == "none":
        pytest.skip("no sandbox level here")
    assert run(io_uring_setup, 1, sandbox=True) == [errno.EACCES]
    assert run(io_uring_setup, 1)[0] in (0, errno.ENOSYS, errno.EPERM), "the control"
