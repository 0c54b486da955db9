"""Mixtral: the Llama (Mistral) decoder with a sparse MoE block in place of every MLP.

Softmax top-k routing with the k weights renormalised; no shared expert. The checkpoint's
`block_sparse_moe` is our `mlp` (a `SparseMoeBlock`), its experts' `w1`/`w3`/`w2` our fused
`w13_weight` (gate, up) and `w2_weight`.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from fleetserve.engine.layers.attention.base import AttentionBackend
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.linear import CheckpointTensor
from fleetserve.engine.layers.rotary import RotaryEmbedding
from fleetserve.engine.models.arch import ModelArch
from fleetserve.engine.models.llama import LlamaForCausalLM
from fleetserve.engine.models.moe_arch import MoeArch
from fleetserve.engine.models.moe_block import MoeModelMixin, SparseMoeBlock


class MixtralForCausalLM(MoeModelMixin, LlamaForCausalLM):
    """Mixtral causal LM (every layer MoE)."""

    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)

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
        return None, SparseMoeBlock(arch, moe, context, prefix=f"{prefix}.mlp")

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        return self.load_moe_weights(weights, super().load_weights)
