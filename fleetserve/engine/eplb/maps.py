"""The expert maps of a MoE model: which logical expert each physical slot holds, and back.

For L MoE layers, E logical and P physical experts (P = E + redundant):
  - `physical_to_logical` [L, P]: the logical expert in each slot;
  - `logical_to_physical` [L, E, max_replicas]: the slots of each logical expert in ascending
    order, padded with -1 (max_replicas = P - E + 1, the most a plan can give one expert, so the
    tensors keep their shape across rebalances and can be updated in place);
  - `logical_replica_count` [L, E]: the non-padding entries of each row.
`ExpertMaps.from_physical_to_logical` derives the other two from the first, so they are inverse by
construction; `check()` proves it for maps from anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetserve.engine.eplb.policy import balancedness

__all__ = ["ExpertMaps", "default_physical_to_logical"]


def default_physical_to_logical(num_logical: int, num_physical: int) -> list[int]:
    """The load-time placement (the MoE layer's default): slot p holds expert p % E."""
    return [p % num_logical for p in range(num_physical)]


@dataclass(frozen=True)
class ExpertMaps:
    """The three maps of every MoE layer (int64 CPU tensors; see the module docstring)."""

    physical_to_logical: torch.Tensor
    logical_to_physical: torch.Tensor
    logical_replica_count: torch.Tensor

    @property
    def num_layers(self) -> int:
        return int(self.physical_to_logical.size(0))

    @property
    def num_physical(self) -> int:
        return int(self.physical_to_logical.size(1))

    @property
    def num_logical(self) -> int:
        return int(self.logical_replica_count.size(1))

    @classmethod
    def from_physical_to_logical(cls, p2l: torch.Tensor, num_logical: int) -> ExpertMaps:
        """The maps of `p2l` [layers, P] (each row must use every expert 0..num_logical-1).

        Raises:
            ValueError: an id out of range, or a logical expert with no slot.
        """
        p2l = p2l.detach().to("cpu", torch.int64)
        if p2l.dim() != 2:
            raise ValueError(f"physical_to_logical must be [layers, P], got {list(p2l.shape)}")
        layers, num_physical = p2l.shape
        if num_physical < num_logical:
            raise ValueError(f"physical_to_logical has {num_physical} slots < {num_logical}")
        if layers and (int(p2l.min()) < 0 or int(p2l.max()) >= num_logical):
            raise ValueError(f"physical_to_logical ids must be in [0, {num_logical})")
        width = num_physical - num_logical + 1
        count = torch.zeros(layers, num_logical, dtype=torch.int64)
        count.scatter_add_(1, p2l, torch.ones_like(p2l))
        if bool((count == 0).any()):
            layer, expert = (int(i) for i in (count == 0).nonzero()[0])
            raise ValueError(f"logical expert {expert} of MoE layer {layer} has no slot")
        # NOTE: a stable sort by logical id lists each expert's slots in ascending order.
        slots = p2l.argsort(dim=-1, stable=True)
        starts = torch.cumsum(count, dim=-1) - count
        l2p = torch.full((layers, num_logical, width), -1, dtype=torch.int64)
        sorted_logical = p2l.gather(-1, slots)
        replica = torch.arange(num_physical).expand(layers, -1) - starts.gather(-1, sorted_logical)
        flat = l2p.view(layers, -1)
        flat.scatter_(1, sorted_logical * width + replica, slots)
        return cls(p2l, l2p, count)

    @classmethod
    def initial(cls, num_layers: int, num_logical: int, num_physical: int) -> ExpertMaps:
        """Every layer at the load-time placement (`default_physical_to_logical`)."""
        row = torch.tensor(default_physical_to_logical(num_logical, num_physical))
        return cls.from_physical_to_logical(row.repeat(num_layers, 1), num_logical)

    def check(self) -> None:
        """Raises AssertionError unless the maps are consistent and inverse to each other:
        each count equals its non-(-1) entries, each listed slot holds that expert, every slot
        is listed exactly once, and every expert has at least one replica."""
        p2l, l2p, count = (
            self.physical_to_logical,
            self.logical_to_physical,
            self.logical_replica_count,
        )
        assert bool((count >= 1).all()), "a logical expert has no replica"
        assert torch.equal((l2p >= 0).sum(-1), count), "replica counts differ from the map"
        for layer in range(self.num_layers):
            listed = l2p[layer][l2p[layer] >= 0]
            assert sorted(listed.tolist()) == list(range(self.num_physical)), (
                f"layer {layer}: slots not listed exactly once"
            )
            for expert in range(self.num_logical):
                slots = l2p[layer, expert][l2p[layer, expert] >= 0]
                assert bool((p2l[layer, slots] == expert).all()), (
                    f"layer {layer}: expert {expert} lists a slot holding another expert"
                )

    def rank_load(self, logical_load: torch.Tensor, num_ranks: int) -> torch.Tensor:
        """[layers, ranks]: each rank's share of `logical_load` [layers, E] when every expert's
        tokens split evenly over its replicas (what the layer's round-robin routing does)."""
        per_slot = (logical_load.to(torch.float64) / self.logical_replica_count).gather(
            -1, self.physical_to_logical
        )
        return per_slot.view(self.num_layers, num_ranks, -1).sum(-1)

    def balancedness(self, logical_load: torch.Tensor, num_ranks: int) -> torch.Tensor:
        """Per layer, mean ÷ max of `rank_load` (the plan's predicted balancedness)."""
        return balancedness(self.rank_load(logical_load, num_ranks))

    def fold(self, physical_load: torch.Tensor) -> torch.Tensor:
        """[layers, E]: load per logical expert from load per physical slot [layers, P]."""
        out = torch.zeros(self.num_layers, self.num_logical, dtype=physical_load.dtype)
        return out.scatter_add_(1, self.physical_to_logical, physical_load.to("cpu"))
