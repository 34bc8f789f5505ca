"""Planned deaths, for exercise 17: a rank killed at a step of its choosing, and its peers noticing.

A rank dies by SIGKILL, as a machine that loses its power or the kernel's out-of-memory killer ends
it: no exception, no ``finally``, no last word. ``launch(..., deaths=(rank,))`` (course/runtime/workers.py's
``run``) expects that death: the rank's result is None and the world is no failure for it; any other
failure still is.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import time
from dataclasses import dataclass

import torch.distributed as dist

# What gloo's and NCCL's errors say when a peer's process is gone (its connection closed or reset).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited")


@dataclass(frozen=True)
class Kill:
    """Rank ``rank`` dies at step ``step``: as the step starts, or, with ``in_save``, as the ranks start the
    checkpoint of that step (its peers are then inside the save, and wait for it there)."""

    rank: int
    step: int
    in_save: bool = False

    def now(self, step: int, saving: bool = False) -> None:
        """Die here, where this rank is the planned one, at its step and place."""
        if (step, saving) == (self.step, self.in_save) and dist.get_rank() == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)

    def __str__(self) -> str:
        return f"rank {self.rank} killed at {'the save of ' if self.in_save else ''}step {self.step}"


def kill_flag(text: str) -> Kill:
    """An argparse type: RANK@STEP."""
    rank, at, step = text.partition("@")
    if not (at and rank.isdigit() and step.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not RANK@STEP (1@20: rank 1 dies at step 20)")
    return Kill(int(rank), int(step))


def lost_a_peer(error: BaseException) -> bool:
    """Whether a collective's error says that a peer's process is gone."""
    return isinstance(error, RuntimeError) and any(words in str(error) for words in _PEER_GONE)


@dataclass
class Lost:
    """What a rank saw of a peer's death: when (time.time()) and the collective's error, or None."""

    when: float | None = None
    error: str | None = None


@contextlib.contextmanager
def until_a_peer_dies():
    """Run the block until a collective in it fails because a peer's process is gone; then go on after
    the block, with what was seen in the Lost this yields. Any other error is raised as it is."""
    lost = Lost()
    try:
        yield lost
    except RuntimeError as error:
        if not lost_a_peer(error):
            raise
        # gloo's first line: "[.../pair.cc:537] Read error [127.0.0.1]:55973: Connection reset by peer. This is ..."
        said = re.sub(r"^\[[^\]]*\] ", "", str(error).splitlines()[0])
        lost.when, lost.error = time.time(), said.split(". ")[0]
