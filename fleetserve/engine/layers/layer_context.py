"""`LayerContext`: the construction-time settings every layer shares, passed down once.

A model builds all its layers from one `(ModelArch, LayerContext)` pair instead of threading
`dtype, device, use_triton` through each constructor. The tensor-parallel rank, size and group
are here so that parallel layers take their shard (and their all-reduce) from it; MoE's
expert-parallel rank and group are here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fleetserve.engine.custom_ops import is_resolved_custom_ops, uses_custom_op

if TYPE_CHECKING:
    from fleetserve.engine.compilation.pieces import CompiledPieces
    from fleetserve.engine.distributed.data_parallel_sync import DPStepSync
    from fleetserve.engine.distributed.group import GroupCoordinator

CUSTOM_OPS: tuple[str, ...] = ("torch", "triton")


@dataclass(frozen=True, slots=True)
class LayerContext:
    """Where and how layers are built."""

    dtype: torch.dtype
    """Weight and activation dtype."""
    device: torch.device
    """Where parameters and tables are allocated."""
    custom_ops: str = "torch"
    """RMSNorm, rotary and SiLU-and-mul as eager torch ops ('torch'), the fused kernels of
    `fleetserve.kernels` ('triton'), or '+op,...' for exactly those ops (`use_custom_op`)."""
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: GroupCoordinator | None = field(default=None, compare=False)
    """The tensor-parallel group (None with one rank): row-parallel layers sum over it."""
    pp_rank: int = 0
    """This rank's pipeline stage."""
    pp_size: int = 1
    pp_partition: tuple[int, ...] | None = None
    """Layers per stage (None: an even split; `stage_layer_range`)."""
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: GroupCoordinator | None = field(default=None, compare=False)
    """The expert-parallel group (None without expert parallelism): MoE layers spread their
    experts over it and sum their outputs over it."""
    moe_backend: str = "torch"
    """MoE expert GEMMs: 'torch' or 'triton' (`fleetserve.engine.layers.fused_moe`)."""
    num_redundant_experts: int = 0
    """Extra physical expert slots of every MoE layer (EPLB replicas; 0 without EPLB)."""
    dp_sync: DPStepSync | None = field(default=None, compare=False)
    """Lockstep data parallel: the DP ranks' token counts of the current forward, and the
    dispatch MoE layers use when their expert-parallel group spans the DP ranks."""
    pieces: CompiledPieces | None = field(default=None, compare=False)
    """The engine's torch.compile'd elementwise pieces (None: every step eager), which RMSNorm,
    rotary and SiLU-and-mul run for steps in their compile range."""

    def __post_init__(self) -> None:
        if self.custom_ops not in CUSTOM_OPS and not is_resolved_custom_ops(self.custom_ops):
            raise ValueError(f"custom_ops must be one of {CUSTOM_OPS}, got {self.custom_ops!r}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank must be in [0, {self.pp_size}), got {self.pp_rank}")
        if self.tp_size > 1 and (self.tp_group is None or self.tp_group.world_size != self.tp_size):
            raise ValueError(f"tp_group must be a group of tp_size ({self.tp_size}) ranks")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank must be in [0, {self.ep_size}), got {self.ep_rank}")
        if self.ep_size > 1 and (self.ep_group is None or self.ep_group.world_size != self.ep_size):
            raise ValueError(f"ep_group must be a group of ep_size ({self.ep_size}) ranks")

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """The decoder layers [start, end) this rank's stage holds.

        Raises:
            ValueError: a partition that does not fit the model (see `stage_layer_range`).
        """
        from fleetserve.engine.distributed.stages import stage_layer_range

        return stage_layer_range(num_layers, self.pp_rank, self.pp_size, self.pp_partition)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def use_triton_ops(self) -> bool:
        return self.custom_ops == "triton"

    def use_custom_op(self, name: str) -> bool:
        """Whether op `name` ('rms_norm', 'rotary', 'silu_and_mul') runs as its custom kernel
        (`fleetserve.kernels.custom_ops`) rather than its torch reference."""
        return uses_custom_op(self.custom_ops, name)
