"""The range of torch the course supports (2.11 to 2.15): what differs across it, in one place.

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
"""

from __future__ import annotations

import warnings

OLDEST, NEWEST = "2.11.0", "2.15.0"

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
    probes, on a group whose collectives the ranks do not compare: torch's code is not what is checked."""
    from torch.distributed.device_mesh import DeviceMesh

    from course.runtime.instrument import unchecked_group

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
