"""The engine arguments' EPLB rules (torch-free): what `EngineArgs` refuses before building.

EPLB balances experts over the expert-parallel group, so it needs a MoE model served with
expert parallelism, and its physical slots (logical + redundant) must split evenly over the EP
ranks (data × tensor; pipeline stages each have their own experts).
"""

from __future__ import annotations

from typing import Any

from fleetserve.engine.models.moe_arch import MOE_ARCHITECTURES, MoeArch, is_moe_config

__all__ = ["check_eplb_args"]


def check_eplb_args(
    *,
    enable_eplb: bool,
    enable_expert_parallel: bool,
    num_redundant_experts: int,
    tensor_parallel_size: int,
    data_parallel_size: int,
    hf_config: dict[str, Any],
) -> None:
    """Raises ValueError (naming the arguments) for EPLB settings the engine cannot serve."""
    if not enable_eplb:
        return
    if not enable_expert_parallel:
        raise ValueError(
            "enable_eplb needs enable_expert_parallel=True (EPLB places experts over the "
            "expert-parallel ranks)"
        )
    if not is_moe_config(hf_config):
        raise ValueError(
            f"enable_eplb needs a MoE model (architectures {sorted(MOE_ARCHITECTURES)})"
        )
    experts = MoeArch.from_hf_config(hf_config).num_experts
    ep = tensor_parallel_size * data_parallel_size
    if num_redundant_experts % ep:
        raise ValueError(
            f"num_redundant_experts ({num_redundant_experts}) must be a multiple of the EP "
            f"group (tensor_parallel_size × data_parallel_size = {ep})"
        )
    if (experts + num_redundant_experts) % ep:
        raise ValueError(
            f"the model's {experts} experts + num_redundant_experts ({num_redundant_experts}) "
            f"must split evenly over the EP group (tensor_parallel_size × "
            f"data_parallel_size = {ep})"
        )
