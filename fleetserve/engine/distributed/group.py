"""`GroupCoordinator`: one process group as a rank sees it, with the collectives it offers.

A group has two channels (seed notes part 2 §2.4): the device group carries tensors (NCCL on
CUDA, gloo on the CPU) and the CPU group (always gloo) carries pickled objects and barriers, so
that control traffic never allocates on the accelerator. A group of one rank has neither: every
collective on it returns its input unchanged, without a call into torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from fleetserve.engine.distributed.shm_allreduce import ShmAllReduce

__all__ = ["GroupCoordinator"]


@dataclass
class GroupCoordinator:
    """One group of ranks (global rank ids, ascending) and this rank's place in it."""

    ranks: list[int]
    """The group's global ranks, ascending."""
    rank: int
    """This process's global rank."""
    device_group: Any = None
    """torch.distributed group for tensors (None for a group of one)."""
    cpu_group: Any = None
    """gloo group for objects and barriers (None for a group of one)."""
    shm: ShmAllReduce | None = None
    """The shared-memory all-reduce for small CPU tensors (None: every all-reduce is gloo's or
    NCCL's)."""

    def __post_init__(self) -> None:
        if self.rank not in self.ranks:
            raise ValueError(f"rank must be one of the group's ranks {self.ranks}, got {self.rank}")

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def is_first(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group in place; returns it (unchanged for a group of one)."""
        if self.world_size == 1:
            return tensor
        if self.shm is not None and self.shm.accepts(tensor):
            return self.shm.all_reduce(tensor)
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim`, in group order (all shapes equal)."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in self.ranks]
        dist.all_gather(parts, tensor.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """`obj` from the group's rank `src` (index in the group) to all; over the CPU group."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank_in_group == src else None]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send `tensor` to the group's rank `dst` (index in the group); blocks until taken."""
        dist.send(tensor.contiguous(), dst=self.ranks[dst], group=self.device_group)

    def recv(self, buffer: torch.Tensor, src: int) -> torch.Tensor:
        """Fill `buffer` (its shape and dtype must match what is sent) from rank `src`."""
        dist.recv(buffer, src=self.ranks[src], group=self.device_group)
        return buffer

    def barrier(self) -> None:
        """Wait for every rank of the group (over gloo: the device is not touched)."""
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        """Release the device group first, then the CPU group (seed part 2 §2.4's order)."""
        for group in (self.device_group, self.cpu_group):
            if group is not None:
                dist.destroy_process_group(group)
        self.device_group = None
        self.cpu_group = None
        self.shm = None
