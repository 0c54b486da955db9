"""Qwen2 causal LM: the Llama decoder with biases on q/k/v only."""

from __future__ import annotations

from typing import Any

from fleetserve.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2/Qwen2.5 dense models; everything but the projection biases is Llama's."""

    uses_sliding_window_by_default = False

    @classmethod
    def projection_biases(cls, hf_config: dict[str, Any]) -> tuple[bool, bool, bool]:
        return True, False, False
