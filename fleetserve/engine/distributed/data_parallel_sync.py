"""`DPStepSync`: a lockstep data-parallel worker's agreement with its DP peers, per forward.

Before every forward (a real one or a dummy one) each rank all-gathers its token count over its
DP group's CPU (gloo) channel, as vLLM's `DPMetadata` does: a dispatch that gathers tokens
across DP ranks needs every rank's count, and the gather itself makes a rank that skipped its
forward visible at once (its peers wait in this collective, bounded by the group's timeout,
instead of deadlocking inside the MoE layers' device collectives).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fleetserve.engine.distributed.group import GroupCoordinator

__all__ = ["DPStepSync"]


class DPStepSync:
    """Per-forward token counts across one DP group (see the module docstring)."""

    def __init__(self, group: GroupCoordinator) -> None:
        self.group = group
        self.num_tokens_across_dp: list[int] = [0] * group.world_size
        """Every DP rank's tokens in the current forward, in DP-rank order (after `sync`)."""
        self.num_forwards = 0
        """Forwards synchronised so far (the same on every DP rank while they keep step)."""

    def sync(self, num_tokens: int) -> list[int]:
        """All-gather this rank's `num_tokens` (0 for a dummy forward); every rank must call
        it once per forward, in the same order. Returns `num_tokens_across_dp`."""
        self.num_forwards += 1
        if self.group.world_size == 1:
            self.num_tokens_across_dp = [num_tokens]
            return self.num_tokens_across_dp
        mine = torch.tensor([num_tokens], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in self.group.ranks]
        dist.all_gather(parts, mine, group=self.group.cpu_group)
        self.num_tokens_across_dp = [int(p.item()) for p in parts]
        return self.num_tokens_across_dp
