"""`FusedMoE`: the routed experts of one MoE layer, on one rank.

Contract (what EPLB and data parallel build on; keep it exact):

- Experts. `num_logical_experts` (L) experts are in the checkpoint; the layer holds
  `num_physical_experts` = L + `num_redundant_experts` (R) slots, spread over the expert-parallel
  group: `ep_size` ranks, this one `ep_rank`, each with `num_local_physical_experts`
  = (L + R) // ep_size slots (a ValueError when it does not divide). Physical slot p lives on EP
  rank p // num_local_physical_experts, at local index p % num_local_physical_experts.
  `physical_to_logical` (a constructor argument, default `p % L`) says which logical expert
  each physical slot holds; loading fills each local slot from that logical expert's
  checkpoint tensors (`load_expert_weight`), so a rank reads only its own experts.
- Weights. `w13_weight` [local, 2I, H] (gate rows, then up rows) and `w2_weight`
  [local, H, I] with the local physical slot as the leading dim; `expert_weights()` returns them
  in this stable order, so that EPLB can rearrange slots in place (copy into `w[i]`).
- Routing gives logical ids [T, k] (`routing.select_experts`). When `eplb_maps` is set (an
  object with `logical_to_physical` LongTensor[L, max_replicas], -1 padded, and
  `logical_replica_count` LongTensor[L]), token t's slot j goes to replica
  (t + j) % replica_count of its logical expert: vectorised, the same on every rank. When it is
  None, physical = logical, which needs R = 0 and the default `physical_to_logical`.
- Load. When `expert_load` is a LongTensor[num_physical_experts] (else None), each forward adds
  its physical ids into it with one `index_add_` (no host sync, no Python loop). With both
  attributes None the layer does nothing extra. With data_parallel_size 1 every rank routes the
  same (replicated, bit-identical) tokens, so each rank's count is already the global count.

Parallelism. Without expert parallelism (ep_size 1) every rank holds all experts, each split
over the tensor-parallel ranks like a dense MLP (I / tp rows of gate/up, the matching columns of
down), and the partial outputs are summed over the TP group. With expert parallelism the
experts are whole and spread over the EP group; hidden states are replicated over the group
(with data_parallel_size 1 it is the TP group), so each rank computes its local experts'
contributions and one all-reduce over the EP group combines them: the same sum as with one rank.

Backends: 'torch' (`torch_experts`: sorted pairs, GEMMs per expert hit) or 'triton' (the fused
grouped-GEMM kernel, `fleetserve.kernels.fused_moe.fused_experts`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from fleetserve.engine.layers.fused_moe.routing import RoutingConfig, select_experts
from fleetserve.engine.layers.fused_moe.torch_experts import torch_experts
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.linear import (
    CheckpointTensor,
    RowSlice,
    copy_checked,
    split_evenly,
)

if TYPE_CHECKING:
    from fleetserve.engine.distributed.group import GroupCoordinator

__all__ = ["MOE_BACKENDS", "EplbMaps", "FusedMoE"]

MOE_BACKENDS: tuple[str, ...] = ("torch", "triton")

_PARTS: tuple[str, ...] = ("gate", "up", "down")


class EplbMaps(Protocol):
    """The logical → physical maps the layer routes through (EPLB owns and updates them)."""

    logical_to_physical: torch.Tensor
    """LongTensor [L, max_replicas]: the physical slots of each logical expert, -1 padded."""
    logical_replica_count: torch.Tensor
    """LongTensor [L]: how many entries of each row are valid (>= 1)."""


def _parameter(shape: tuple[int, ...], context: LayerContext) -> nn.Parameter:
    return nn.Parameter(
        torch.empty(shape, dtype=context.dtype, device=context.device), requires_grad=False
    )


class FusedMoE(nn.Module):
    """Routed experts of one layer (see the module docstring for the contract).

    Args:
        num_experts: logical experts L (`num_local_experts`, `num_experts`, `n_routed_experts`).
        hidden_size: H.
        intermediate_size: each expert's I (before any tensor-parallel split).
        routing: how tokens pick experts.
        context: dtype, device, tensor- and expert-parallel ranks and groups, backend.
        num_redundant_experts: R extra physical slots (EPLB replicas).
        physical_to_logical: [L + R] logical expert of each physical slot (default p % L).
        prefix: the module's qualified name (for error messages).

    Raises:
        ValueError: sizes that do not divide over the ranks, a bad map, or a routing that does
            not fit the experts.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        routing: RoutingConfig,
        context: LayerContext,
        *,
        num_redundant_experts: int = 0,
        physical_to_logical: list[int] | None = None,
        prefix: str = "experts",
    ) -> None:
        super().__init__()
        routing.check(num_experts)
        if num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {num_redundant_experts}")
        if context.moe_backend not in MOE_BACKENDS:
            raise ValueError(
                f"moe_backend must be one of {MOE_BACKENDS}, got {context.moe_backend!r}"
            )
        self.prefix = prefix
        self.routing = routing
        self.backend = context.moe_backend
        self.num_logical_experts = num_experts
        self.num_redundant_experts = num_redundant_experts
        self.num_physical_experts = num_experts + num_redundant_experts
        self.ep_size = context.ep_size
        self.ep_rank = context.ep_rank
        if self.num_physical_experts % self.ep_size != 0:
            raise ValueError(
                f"the physical experts (num_experts {num_experts} + num_redundant_experts "
                f"{num_redundant_experts}) must be divisible by the expert-parallel size "
                f"({self.ep_size})"
            )
        self.num_local_physical_experts = self.num_physical_experts // self.ep_size
        if physical_to_logical is None:
            physical_to_logical = [p % num_experts for p in range(self.num_physical_experts)]
        if len(physical_to_logical) != self.num_physical_experts or any(
            not 0 <= e < num_experts for e in physical_to_logical
        ):
            raise ValueError(
                f"physical_to_logical must list {self.num_physical_experts} logical expert ids "
                f"in [0, {num_experts}), got {physical_to_logical}"
            )
        self.physical_to_logical = list(physical_to_logical)
        self._identity_map = num_redundant_experts == 0 and self.physical_to_logical == list(
            range(num_experts)
        )
        self.dp_sync = (
            context.dp_sync
            if self.ep_size > 1 and context.dp_sync is not None and context.tp_size == 1
            else None
        )
        """Lockstep data parallel with the EP group over the DP ranks (tensor parallel 1):
        tokens are gathered from every DP rank and the outputs combined back over the EP
        group, which has the DP group's ranks (`distributed.data_parallel_sync`)."""
        self.inter_slice, self.reduce_group = self._split(context, intermediate_size)
        local, inter = self.num_local_physical_experts, self.inter_slice.size
        self.hidden_size = hidden_size
        self.w13_weight = _parameter((local, 2 * inter, hidden_size), context)
        self.w2_weight = _parameter((local, hidden_size, inter), context)
        self.e_score_correction_bias: nn.Parameter | None = None
        if routing.use_correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32, device=context.device),
                requires_grad=False,
            )
        self.eplb_maps: EplbMaps | None = None
        """Set by EPLB: route logical ids to physical replicas (see the contract)."""
        self.expert_load: torch.Tensor | None = None
        """Set by EPLB: LongTensor [num_physical_experts], each forward's physical ids counted."""
        self._loaded: set[tuple[int, str]] = set()

    def _split(
        self, context: LayerContext, intermediate_size: int
    ) -> tuple[RowSlice, GroupCoordinator | None]:
        """The intermediate rows each expert keeps here, and the group its output is summed
        over: whole experts and the EP group under expert parallelism, else I / tp rows and
        the TP group (None with one rank)."""
        if self.ep_size == 1:
            rows = split_evenly(
                intermediate_size, context.tp_rank, context.tp_size, what="moe_intermediate_size"
            )
            return rows, context.tp_group
        if context.tp_size != self.ep_size and self.dp_sync is None:
            # NOTE: EP over DP × TP needs each DP rank's tokens dispatched to the others first
            # (`dp_sync`: lockstep data parallel, tensor parallel 1); else only the
            # replicated-hidden case is built.
            raise ValueError(
                f"expert parallel over {self.ep_size} ranks with tensor_parallel_size "
                f"{context.tp_size} needs data-parallel dispatch, which is not built; "
                "the expert-parallel group must be the tensor-parallel group"
            )
        whole = RowSlice(intermediate_size, 0, intermediate_size)
        tp_group, ep_group = context.tp_group, context.ep_group
        # NOTE: with data_parallel_size 1 the EP group has the TP group's ranks, and the TP
        # coordinator carries the one-host shared-memory all-reduce: sum over it.
        if tp_group is not None and ep_group is not None and tp_group.ranks == ep_group.ranks:
            return whole, tp_group
        return whole, ep_group

    # -- the contract ------------------------------------------------------------------------

    def expert_weights(self) -> list[torch.Tensor]:
        """The per-rank expert tensors, local physical slot first: [w13, w2] (stable order)."""
        return [self.w13_weight.data, self.w2_weight.data]

    @property
    def local_physical_experts(self) -> range:
        """The physical slots this rank holds."""
        start = self.ep_rank * self.num_local_physical_experts
        return range(start, start + self.num_local_physical_experts)

    def to_physical(self, logical_ids: torch.Tensor) -> torch.Tensor:
        """Logical ids [T, k] → physical ids [T, k] (through `eplb_maps` when set).

        Raises:
            ValueError: no maps while the slots are not the identity (redundant experts or a
                custom `physical_to_logical`).
        """
        maps = self.eplb_maps
        if maps is None:
            if not self._identity_map:
                raise ValueError(
                    f"{self.prefix}: eplb_maps must be set when num_redundant_experts > 0 or "
                    "physical_to_logical is not the identity"
                )
            return logical_ids
        num_tokens, top_k = logical_ids.shape
        offset = torch.arange(num_tokens, device=logical_ids.device).unsqueeze(1) + torch.arange(
            top_k, device=logical_ids.device
        )
        replica = offset % maps.logical_replica_count[logical_ids]
        return maps.logical_to_physical[logical_ids, replica]

    # -- forward -----------------------------------------------------------------------------

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        shared_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden [T, H], router logits [T, L] → the weighted sum of each token's experts [T, H]
        (summed over the tensor- or expert-parallel group).

        `shared_output`, when given, is this rank's partial [T, H] of a shared expert on the
        same tokens (its tensor-parallel slice, not yet summed; the group here has the TP
        ranks): it is added before the sum, so one all-reduce combines both.
        """
        dp_sync = self.dp_sync
        if dp_sync is not None:
            # NOTE: every DP rank routes every rank's tokens, so each count is the global one.
            hidden_states = dp_sync.gather(hidden_states)
            router_logits = dp_sync.gather(router_logits)
        weights, logical = select_experts(router_logits, self.routing, self.e_score_correction_bias)
        physical = self.to_physical(logical)
        if self.expert_load is not None:
            flat = physical.flatten()
            self.expert_load.index_add_(0, flat, torch.ones_like(flat))
        local = physical - self.ep_rank * self.num_local_physical_experts
        if self.backend == "triton":
            from fleetserve.kernels.fused_moe import fused_experts

            out = fused_experts(
                hidden_states.contiguous(), self.w13_weight, self.w2_weight, weights, local
            )
        else:
            out = torch_experts(hidden_states, self.w13_weight, self.w2_weight, weights, local)
        if dp_sync is not None:
            # NOTE: tensor parallel 1: the shared expert's output is whole for this rank's rows.
            out = dp_sync.combine(out)
            return out if shared_output is None else out + shared_output
        if shared_output is not None:
            out = out + shared_output
        if self.reduce_group is not None:
            out = self.reduce_group.all_reduce(out)
        return out

    # -- loading -----------------------------------------------------------------------------

    def load_expert_weight(
        self, logical_expert: int, part: str, loaded: CheckpointTensor, name: str
    ) -> bool:
        """Copy this rank's share of one logical expert's `part` ('gate' [I, H], 'up' [I, H] or
        'down' [H, I]) into every local slot that holds it; returns whether any did (a rank
        that holds none of its replicas reads nothing).

        Raises:
            ValueError: an unknown part or expert, or a tensor of the wrong shape.
        """
        if part not in _PARTS:
            raise ValueError(f"part must be one of {_PARTS}, got {part!r}")
        if not 0 <= logical_expert < self.num_logical_experts:
            raise ValueError(
                f"checkpoint tensor {name}: expert id must be in "
                f"[0, {self.num_logical_experts}), got {logical_expert}"
            )
        rows = self.inter_slice
        slots = [
            i
            for i, p in enumerate(self.local_physical_experts)
            if self.physical_to_logical[p] == logical_expert
        ]
        if not slots:
            return False
        if part == "down":
            if len(loaded.shape) != 2 or loaded.shape[1] != rows.full:
                raise ValueError(
                    f"checkpoint tensor {name} has shape {tuple(loaded.shape)}, expected "
                    f"[{self.hidden_size}, {rows.full}]"
                )
            tensor = loaded.narrow(1, rows.start, rows.size)
        else:
            if loaded.shape[0] != rows.full:
                raise ValueError(
                    f"checkpoint tensor {name} has {loaded.shape[0]} rows, expected {rows.full}"
                )
            tensor = loaded.narrow(0, rows.start, rows.size)
        for i in slots:
            if part == "down":
                target = self.w2_weight.data[i]
            else:
                start = 0 if part == "gate" else rows.size
                target = self.w13_weight.data[i, start : start + rows.size]
            copy_checked(target, tensor, name)
            self._loaded.add((i, part))
        return True

    def fully_loaded(self) -> bool:
        """Whether every local slot got its gate, up and down tensors."""
        return len(self._loaded) == self.num_local_physical_experts * len(_PARTS)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_logical_experts}+{self.num_redundant_experts}, "
            f"local={self.num_local_physical_experts}, ep={self.ep_rank}/{self.ep_size}, "
            f"top_k={self.routing.top_k}, backend={self.backend!r}"
        )
