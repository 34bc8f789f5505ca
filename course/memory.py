"""How much memory the gathered parameters of a sharded model hold, measured from the outside.

Exercise 13's units keep each layer's parameters as a flat shard and all-gather them into a full
buffer when the layer needs them. ``with Gathered() as gathered:`` notes every buffer that an
all-gather writes into, whoever made it and whatever name holds it, by weak reference to its
storage: the note never keeps a buffer alive, and a buffer counts for as many bytes as its storage
holds at that moment (0 once freed by resizing the storage, none once no tensor uses it). At the
start of every collective, and at every ``mark``, it takes a sample: the element counts of the
gathered buffers alive, and for a collective the element count of its larger tensor (an
all-gather's output, a reduce-scatter's input: the full tensor it is about). dist.all_gather's
list of outputs is followed too, each tensor of it. Exercise 13's script reports the peak; its
checks read the samples.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed import ProcessGroup

from course.runtime.compat import collective

# The process group methods of dist.all_gather_into_tensor, the all-gather that writes one output
# tensor (from torch 2.13 on, and before: course/runtime/compat.py), and the others sampled at their start.
GATHERS = ("all_gather_single", "_allgather_base")
SAMPLED = GATHERS + ("reduce_scatter_single", "_reduce_scatter_base", "allreduce", "allgather", "broadcast")


class Gathered:
    """Follows the buffers all-gathers write into, for the duration of a with block, in this process."""

    def __init__(self):
        self.buffers: list = []  # (weak reference to a storage, bytes per element), in order of first gather
        self.samples: list = []  # {"at": what, "alive": [element counts], "bytes": alive, "numel": of a collective}

    def __enter__(self):
        self._saved = {name: vars(ProcessGroup)[name] for name in SAMPLED if name in vars(ProcessGroup)}
        for name, method in self._saved.items():
            setattr(ProcessGroup, name, self._sampling(name, method))
        return self

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(ProcessGroup, name, method)

    def _sampling(self, name, method):
        def sampled(group, *args, **kwargs):
            tensors = [t for t in args[:2] if isinstance(t, torch.Tensor)]
            if name in GATHERS and tensors:
                self._follow(tensors[0])
            if name == "allgather" and args and isinstance(args[0], list):  # dist.all_gather: a list per input
                for output in (t for outputs in args[0] for t in outputs if isinstance(t, torch.Tensor)):
                    self._follow(output)
            self.sample(collective(name), max((t.numel() for t in tensors), default=None))
            return method(group, *args, **kwargs)

        return sampled

    def _follow(self, output: torch.Tensor) -> None:
        storage = output.untyped_storage()
        if not any(ref() is storage for ref, _ in self.buffers):
            self.buffers.append((weakref.ref(storage), output.element_size()))

    def alive(self) -> list[int]:
        """Element counts of the gathered buffers that hold memory now."""
        counts = []
        for ref, size in self.buffers:
            storage = ref()
            if storage is not None and storage.nbytes() > 0:
                counts.append(storage.nbytes() // size)
        return counts

    def alive_bytes(self) -> int:
        return sum(storage.nbytes() for ref, _ in self.buffers if (storage := ref()) is not None)

    def sample(self, at: str, numel: int | None = None) -> None:
        self.samples.append({"at": at, "alive": self.alive(), "bytes": self.alive_bytes(), "numel": numel})

    def mark(self, label: str) -> None:
        """Note a moment of the computation (a layer's forward, the end of backward) with a sample."""
        self.sample(label)

    def peak_bytes(self) -> int:
        return max((s["bytes"] for s in self.samples), default=0)
