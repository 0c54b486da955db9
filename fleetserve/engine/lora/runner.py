"""The model runner's LoRA side: wrap the model once, then each step load, activate and map
the adapters of the scheduled requests."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fleetserve.engine.lora.config import LoRAConfig
from fleetserve.engine.lora.layers import LoRAStepState
from fleetserve.engine.lora.manager import LoRAModelManager, create_lora_modules
from fleetserve.engine.lora.request import LoRARequest
from fleetserve.engine.lora.weights import LoRAModel

__all__ = ["LoRARunner"]


class LoRARunner:
    """Owns the wrapped layers and the adapter caches of one rank's model.

    Args:
        config: the engine's LoRA settings.
        model: the loaded model (its projections are wrapped in place).
        max_num_tokens: the most tokens a step (or a padded graph batch) carries.
        device: where the model runs.
    """

    def __init__(
        self, config: LoRAConfig, model: nn.Module, max_num_tokens: int, device: torch.device
    ) -> None:
        self.config = config
        self.state = LoRAStepState(max_num_tokens, config.max_loras, device)
        stacked = getattr(model, "stacked_params_mapping", lambda: ())()
        modules = create_lora_modules(
            model, stacked, config.max_loras, config.max_lora_rank, self.state
        )
        if not modules:
            raise ValueError("the model has no layers LoRA can wrap")
        self.manager = LoRAModelManager(modules, self.state, config.max_loras, config.max_cpu_loras)

    def step_uses_lora(self, lora_requests: Sequence[LoRARequest | None]) -> bool:
        return any(lora is not None for lora in lora_requests)

    def prepare_step(
        self,
        lora_requests: Sequence[LoRARequest | None],
        num_tokens: Sequence[int],
    ) -> None:
        """Load (first use or after CPU eviction), activate and map the step's adapters.

        Args:
            lora_requests: per scheduled request in the flat token order, its adapter.
            num_tokens: per scheduled request, its tokens this step.

        Raises:
            ValueError: an adapter that cannot be loaded, or more adapters than slots.
        """
        needed: dict[int, LoRARequest] = {}
        for lora in lora_requests:
            if lora is not None:
                needed.setdefault(lora.lora_int_id, lora)
        registered = set(self.manager.registered_ids)
        for lora_id in needed:
            if lora_id in registered:
                self.manager.touch_adapter(lora_id)
        for lora_id, lora in needed.items():
            if lora_id not in registered:
                self.manager.add_adapter(
                    LoRAModel.from_folder(lora_id, lora.lora_path, self.config.max_lora_rank)
                )
        self.manager.set_active_adapters(list(needed))
        ids = [0 if lora is None else lora.lora_int_id for lora in lora_requests]
        self.manager.set_adapter_mapping(ids, num_tokens)
