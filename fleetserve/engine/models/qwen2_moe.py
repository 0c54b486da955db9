"""Qwen2-MoE: the Qwen2 decoder (q/k/v biases) with sparse MoE blocks and a gated shared expert.

Softmax top-k routing, renormalised only when `norm_topk_prob` is set; every token also goes
through the shared expert, scaled by sigmoid(`shared_expert_gate`). Layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense MLP of
`intermediate_size`.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from fleetserve.engine.layers.attention.base import AttentionBackend
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.linear import CheckpointTensor
from fleetserve.engine.layers.rotary import RotaryEmbedding
from fleetserve.engine.models.arch import ModelArch
from fleetserve.engine.models.moe_arch import MoeArch
from fleetserve.engine.models.moe_block import MoeModelMixin, SparseMoeBlock
from fleetserve.engine.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeForCausalLM(MoeModelMixin, Qwen2ForCausalLM):
    """Qwen2-MoE (and Qwen1.5-MoE) causal LM."""

    def decoder_layer_parts(
        self,
        arch: ModelArch,
        context: LayerContext,
        attn_backend: type[AttentionBackend],
        index: int,
        rotary: RotaryEmbedding,
        prefix: str,
    ) -> tuple[nn.Module | None, nn.Module | None]:
        moe = MoeArch.from_hf_config(arch.hf_config)
        if not moe.is_moe_layer(index):
            return None, None
        return None, SparseMoeBlock(arch, moe, context, prefix=f"{prefix}.mlp")

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        return self.load_moe_weights(weights, super().load_weights)
