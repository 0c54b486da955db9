"""A small MoE layer that follows the FusedMoE contract EPLB builds against (a real tensor
computation, not a mock): E logical experts, each a [dim, dim] matrix; P = E + redundant
physical slots, `P // ep_size` of them on each EP rank (local slot leading); tokens routed to
logical experts are mapped to physical slots by replica `(token + k) % replica_count` when
`eplb_maps` is set, counted into `expert_load` when it is set, and each rank computes its
slots' share, summed over the EP group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def logical_weights(num_logical: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_logical, dim, dim, generator=gen, dtype=torch.float64)


class StandInMoE(torch.nn.Module):
    def __init__(
        self,
        num_logical: int,
        num_redundant: int,
        dim: int,
        *,
        ep_size: int = 1,
        ep_rank: int = 0,
        seed: int = 0,
        group: Any = None,
        physical_to_logical: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.num_logical_experts = num_logical
        self.num_redundant_experts = num_redundant
        self.num_physical_experts = num_logical + num_redundant
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.num_local_physical_experts = self.num_physical_experts // ep_size
        self.physical_to_logical = physical_to_logical or [
            p % num_logical for p in range(self.num_physical_experts)
        ]
        k = self.num_local_physical_experts
        local = self.physical_to_logical[ep_rank * k : (ep_rank + 1) * k]
        self.weight = logical_weights(num_logical, dim, seed)[local].clone()
        self.group = group
        self.eplb_maps: Any = None
        self.expert_load: torch.Tensor | None = None

    def expert_weights(self) -> list[torch.Tensor]:
        return [self.weight]

    def physical_ids(self, logical_ids: torch.Tensor) -> torch.Tensor:
        if self.eplb_maps is None:
            return logical_ids
        tokens, top_k = logical_ids.shape
        count = self.eplb_maps.logical_replica_count[logical_ids]
        replica = (torch.arange(tokens)[:, None] + torch.arange(top_k)[None, :]) % count
        return self.eplb_maps.logical_to_physical[logical_ids, replica]

    def forward(self, x: torch.Tensor, logical_ids: torch.Tensor) -> torch.Tensor:
        physical = self.physical_ids(logical_ids)
        if self.expert_load is not None:
            flat = physical.flatten()
            self.expert_load.index_add_(0, flat, torch.ones_like(flat))
        k = self.num_local_physical_experts
        local = physical - self.ep_rank * k
        mine = (local >= 0) & (local < k)
        w = self.weight[local.clamp(0, k - 1)]  # [T, top_k, dim, dim]
        out = torch.einsum("td,tkde->tke", x, w) * mine[..., None]
        out = out.sum(1)
        if self.group is not None and self.ep_size > 1:
            dist.all_reduce(out, group=self.group)
        return out


def reference(x: torch.Tensor, logical_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The same layer computed densely from the logical weights."""
    return torch.einsum("td,tkde->te", x, weights[logical_ids])


def skewed_ids(tokens: int, top_k: int, num_logical: int, hot: int, seed: int) -> torch.Tensor:
    """Routed ids where expert `hot` and its neighbour take most tokens (distinct per row)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, num_logical, generator=gen)
    scores[:, hot] += 2.0
    scores[:, (hot + 1) % num_logical] += 1.0
    return scores.topk(top_k, dim=-1).indices
