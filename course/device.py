"""The device this rank computes on, as the launcher chose it (see course/runtime/env.py, choose_device).

The lesson code asks ``current_device()`` and moves its model and data there; everything else
about GPUs (which one, which backend) is decided by ``course.launch``.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

_VARIABLE = "COURSE_DEVICE"


def select(device: str) -> None:
    """Make ``device`` this process's device: current_device() returns it from now on."""
    os.environ[_VARIABLE] = device
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # NCCL and new CUDA tensors use the current GPU


@contextmanager
def using(device: str):
    """select(device) for the duration of a with block, then the previous choice again."""
    before = os.environ.get(_VARIABLE)
    select(device)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_VARIABLE, None)
        else:
            select(before)


def current_device() -> torch.device:
    """This rank's device: its own GPU when the launcher gave it one, else the CPU."""
    return torch.device(os.environ.get(_VARIABLE, "cpu"))


def bound_device(backend: str) -> torch.device | None:
    """init_process_group's device_id: this rank's GPU under nccl, None otherwise.

    Bound to a GPU, NCCL sets up the world's communicator inside init_process_group, with every
    rank present. Unbound, it sets up a communicator for each pair of ranks at their first send,
    in a call that waits for the peer: the ring of exercise 5 then waits all around the ring.
    """
    return current_device() if backend == "nccl" else None


def synchronize(device: torch.device) -> None:
    """Wait until the device has finished the work queued on it: GPU calls return before they are done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ddp_device_ids(model: torch.nn.Module) -> list | None:
    """DistributedDataParallel's device_ids for a model: its GPU, or None for a CPU model."""
    device = next(model.parameters()).device
    return [device] if device.type == "cuda" else None


def amp_dtype(device: torch.device) -> torch.dtype:
    """The 16-bit type for mixed precision: bfloat16, or float16 on GPUs without bfloat16 (before Ampere).

    float16 needs loss scaling (torch.amp.GradScaler) so that small gradients do not round to
    zero; bfloat16 has float32's range and needs none. Older GPUs (V100, T4) emulate bfloat16,
    slowly, and is_bf16_supported() counts that unless told not to.
    """
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.float16
    return torch.bfloat16
