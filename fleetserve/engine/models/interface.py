"""The contract every model class implements (what the loader and the model runner call)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from fleetserve.engine.distributed.pipeline import IntermediateTensors
from fleetserve.engine.layers.attention.base import AttentionBackend
from fleetserve.engine.layers.forward_context import ForwardContext
from fleetserve.engine.layers.linear import CheckpointTensor


class CausalLM(nn.Module, ABC):
    """A decoder-only LM over a flat token batch with a paged KV cache.

    Construction: `cls(arch, layer_context, attn_backend=..., max_position=...)` with a
    `ModelArch` and a `LayerContext`; every attention layer is an `Attention` module whose
    `layer_name` is its qualified module name.
    """

    attn_backend: type[AttentionBackend]
    """The attention backend every layer uses (its capabilities decide CUDA graph capture)."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ForwardContext,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions [num_tokens] → hidden states [num_tokens, hidden_size].

        `context` carries the step's attention metadata, the KV caches by layer name and the
        optional per-layer KV hooks. Under pipeline parallelism a later stage starts from the
        previous stage's `intermediate` (ignoring input_ids), and a stage before the last
        returns its `IntermediateTensors` instead of hidden states.
        """

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Hidden states [n, hidden_size] → float32 logits [n, vocab_size]."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Fill parameters from (checkpoint name, tensor) pairs; each rank reads only its part
        of a tensor (`CheckpointTensor.narrow`). Returns the names filled."""

    @abstractmethod
    def tie_lm_head(self) -> None:
        """Use the input embedding as the output projection."""
