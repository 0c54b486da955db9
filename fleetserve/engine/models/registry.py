"""Architecture name (config.json `architectures[0]`) → model class."""

from __future__ import annotations

from fleetserve.engine.models.interface import CausalLM
from fleetserve.engine.models.llama import LlamaForCausalLM
from fleetserve.engine.models.oot_registry import out_of_tree_architectures
from fleetserve.engine.models.qwen2 import Qwen2ForCausalLM


def supported_architectures() -> dict[str, type[CausalLM]]:
    """The architectures this engine runs (a fresh dict: callers may not mutate a shared one)."""
    built_in: dict[str, type[CausalLM]] = {
        "LlamaForCausalLM": LlamaForCausalLM,
        # NOTE: Mistral's dense decoder is Llama's; sliding windows are rejected at construction.
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": Qwen2ForCausalLM,
    }
    # NOTE: plugins' architectures (`oot_registry.register_model`) never shadow built-in ones.
    return {**out_of_tree_architectures(), **built_in}


def resolve_model_class(architecture: str) -> type[CausalLM]:
    """Raises ValueError listing the supported architectures when `architecture` is unknown."""
    registry = supported_architectures()
    if architecture not in registry:
        raise ValueError(
            f"architectures[0] must be one of {sorted(registry)}, got {architecture!r}"
        )
    return registry[architecture]
