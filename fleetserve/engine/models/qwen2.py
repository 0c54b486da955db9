"""Qwen2 causal LM: the Llama decoder with biases on q/k/v only."""

from __future__ import annotations

from fleetserve.engine.models.arch import ModelArch
from fleetserve.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2/Qwen2.5 dense models; everything but the projection biases is Llama's."""

    uses_sliding_window_by_default = False

    @classmethod
    def projection_biases(cls, arch: ModelArch) -> tuple[bool, bool, bool]:
        return True, False, False
