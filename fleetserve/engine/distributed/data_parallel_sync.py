"""`DPStepSync`: a lockstep data-parallel worker's agreement with its DP peers, per forward.

Before every forward (a real one or a dummy one) each rank all-gathers its token count over its
DP group's CPU (gloo) channel, as vLLM's `DPMetadata` does: a dispatch that gathers tokens
across DP ranks needs every rank's count, and the gather itself makes a rank that skipped its
forward visible at once (its peers wait in this collective, bounded by the group's timeout,
instead of deadlocking inside the MoE layers' device collectives).

The MoE layers' data-parallel dispatch (expert parallel over DP ranks, tensor parallel 1) uses
these counts: `gather` concatenates every rank's rows in DP-rank order (a padded all-gather over
the device group), the experts run on all of them, and `combine` sums the partial outputs over
the group and keeps this rank's rows (an all-reduce, then a slice: a reduce-scatter's result).
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
        """All-gather the rows of this rank's coming forward (1 for a dummy forward's padding
        row); every rank must call it once per forward, in the same order. Returns
        `num_tokens_across_dp`."""
        self.num_forwards += 1
        if self.group.world_size == 1:
            self.num_tokens_across_dp = [num_tokens]
            return self.num_tokens_across_dp
        mine = torch.tensor([num_tokens], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in self.group.ranks]
        dist.all_gather(parts, mine, group=self.group.cpu_group)
        self.num_tokens_across_dp = [int(p.item()) for p in parts]
        return self.num_tokens_across_dp

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """[this rank's tokens, ...] → [every rank's tokens, ...], in DP-rank order.

        Raises:
            ValueError: `local` does not have the rows `sync` announced for this rank.
        """
        counts = self.num_tokens_across_dp
        mine = counts[self.group.rank_in_group]
        if local.shape[0] != mine:
            raise ValueError(f"this forward announced {mine} tokens, got {local.shape[0]} rows")
        if self.group.world_size == 1:
            return local
        longest = max(counts)
        padded = local.new_zeros((longest, *local.shape[1:]))
        padded[:mine] = local
        parts = self.group.all_gather(padded, dim=0).split(longest, dim=0)
        return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)], dim=0)

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """Every rank's partial sums over all tokens [every rank's tokens, ...] → the summed
        rows of this rank's tokens (all-reduce over the group, then this rank's slice)."""
        total = self.group.all_reduce(partial)
        counts = self.num_tokens_across_dp
        start = sum(counts[: self.group.rank_in_group])
        return total[start : start + counts[self.group.rank_in_group]]
