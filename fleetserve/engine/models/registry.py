"""Architecture name (config.json `architectures[0]`) → model class."""

from __future__ import annotations

from fleetserve.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from fleetserve.engine.models.interface import CausalLM
from fleetserve.engine.models.llama import LlamaForCausalLM
from fleetserve.engine.models.mixtral import MixtralForCausalLM
from fleetserve.engine.models.qwen2 import Qwen2ForCausalLM
from fleetserve.engine.models.qwen2_moe import Qwen2MoeForCausalLM
from fleetserve.engine.models.qwen3_moe import Qwen3MoeForCausalLM


def supported_architectures() -> dict[str, type[CausalLM]]:
    """The architectures this engine runs (a fresh dict: callers may not mutate a shared one)."""
    return {
        "LlamaForCausalLM": LlamaForCausalLM,
        # NOTE: Mistral's dense decoder is Llama's; sliding windows are rejected at construction.
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": Qwen2ForCausalLM,
        "MixtralForCausalLM": MixtralForCausalLM,
        "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
        "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    }


def resolve_model_class(architecture: str) -> type[CausalLM]:
    """Raises ValueError listing the supported architectures when `architecture` is unknown."""
    registry = supported_architectures()
    if architecture not in registry:
        raise ValueError(
            f"architectures[0] must be one of {sorted(registry)}, got {architecture!r}"
        )
    return registry[architecture]
