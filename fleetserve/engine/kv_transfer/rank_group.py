"""The tensor-parallel ranks of one engine, as the connector's worker roles see each other.

Every rank's worker role moves its own share of the KV heads, but only the driver rank's step
output reaches the scheduler; so the roles agree through this group: at registration each rank
learns every rank's endpoint (the driver answers handshakes with all of them), and each step the
ranks exchange which loads ended (`P2PConnectorWorker.end_step`), so that the driver reports a
load only once every rank has its share. Both are collectives: every rank calls them in the same
order (registration once, then once per step, which every rank runs with the same step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from fleetserve.engine.distributed.group import GroupCoordinator

__all__ = ["RankGroup", "SingleRank", "TensorRanks"]


class RankGroup(Protocol):
    @property
    def rank(self) -> int:
        """This rank's index in the group (0 is the driver, whose output the scheduler reads)."""
        ...

    @property
    def size(self) -> int: ...

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (a collective; picklable objects)."""
        ...


class SingleRank:
    """An engine of one rank: nothing to agree on."""

    rank = 0
    size = 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]


class TensorRanks:
    """The engine's tensor-parallel group, over its gloo CPU channel (no device memory)."""

    def __init__(self, group: GroupCoordinator) -> None:
        self._group = group

    @property
    def rank(self) -> int:
        return self._group.rank_in_group

    @property
    def size(self) -> int:
        return self._group.world_size

    def all_gather(self, obj: Any) -> list[Any]:
        if self._group.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self._group.world_size
        dist.all_gather_object(out, obj, group=self._group.cpu_group)
        return out
