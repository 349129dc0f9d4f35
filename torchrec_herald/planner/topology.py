"""The planner's view of the cluster, built the way current TorchRec asks: ``TopologyFactory``, and a
storage reservation that does not guess the dense size.

TorchRec 1.9 warns when a ``Topology`` is constructed directly, and when its planner falls back to
``HeuristicalStorageReservation`` (it over-estimates dense tensors of meta-built models); both helpers
here avoid the two, on TorchRec 1.8 as on 1.9.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import KernelConfig, StorageReservation, Topology, TopologyFactory, TrainerConfig

__all__ = ["STORAGE_RESERVATION_PERCENTAGE", "default_storage_reservation", "make_topology"]

#: share of each rank's memory the planner keeps free for everything but the tables (TorchRec's default)
STORAGE_RESERVATION_PERCENTAGE = 0.15


def make_topology(world_size: Optional[int] = None, compute_device: Optional[str] = None,
                  local_world_size: Optional[int] = None) -> Topology:
    """A TorchRec ``Topology`` through ``TopologyFactory``.

    Args:
        world_size: ranks; default: the initialised process group's size, else 1.
        compute_device: ``"cuda"`` or ``"cpu"``; default: ``cuda`` when a GPU is visible.
        local_world_size: ranks per host; default: ``$LOCAL_WORLD_SIZE`` (torchrun sets it), else
            ``world_size``.
    """
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    if compute_device is None:
        compute_device = "cuda" if torch.cuda.is_available() else "cpu"
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=int(world_size), local_world_size=int(local_world_size)),
        kernel_config=KernelConfig(compute_device=compute_device))


def default_storage_reservation() -> StorageReservation:
    """``FixedPercentageStorageReservation`` of :data:`STORAGE_RESERVATION_PERCENTAGE`, the policy TorchRec
    1.9 recommends over its heuristic default."""
    return FixedPercentageStorageReservation(STORAGE_RESERVATION_PERCENTAGE)
