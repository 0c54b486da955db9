"""Qwen3-MoE: Qwen3's attention (an RMSNorm on each query and key head before RoPE, no
biases) with sparse MoE blocks (softmax top-k, `norm_topk_prob`; no shared expert)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fleetserve.engine.layers.attention.base import AttentionBackend
from fleetserve.engine.layers.forward_context import ForwardContext
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.linear import CheckpointTensor
from fleetserve.engine.layers.norm import RMSNorm
from fleetserve.engine.layers.rotary import RotaryEmbedding
from fleetserve.engine.models.arch import ModelArch
from fleetserve.engine.models.llama import LlamaAttention, LlamaForCausalLM
from fleetserve.engine.models.moe_arch import MoeArch
from fleetserve.engine.models.moe_block import MoeModelMixin, SparseMoeBlock


class Qwen3Attention(LlamaAttention):
    """Llama's attention with `q_norm` / `k_norm` over each head's dims (before rotation)."""

    def __init__(
        self,
        arch: ModelArch,
        context: LayerContext,
        rotary: RotaryEmbedding,
        backend_cls: type[AttentionBackend],
        *,
        prefix: str,
    ) -> None:
        bias = arch.attention_bias
        super().__init__(
            arch, context, rotary, backend_cls, qkv_bias=bias, o_bias=bias, prefix=prefix
        )
        self.q_norm = RMSNorm(arch.head_size, arch.rms_norm_eps, context)
        self.k_norm = RMSNorm(arch.head_size, arch.rms_norm_eps, context)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, context: ForwardContext
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # NOTE: 2-D for the norm (the fused kernel normalises rows), then back to heads.
        q = self.q_norm(q.reshape(-1, self.head_size)).view(-1, self.num_heads, self.head_size)
        k = self.k_norm(k.reshape(-1, self.head_size)).view(-1, self.num_kv_heads, self.head_size)
        v = v.reshape(-1, self.num_kv_heads, self.head_size)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, context)
        return self.o_proj(out.reshape(-1, self.q_size))


class Qwen3MoeForCausalLM(MoeModelMixin, LlamaForCausalLM):
    """Qwen3-MoE causal LM."""

    uses_sliding_window_by_default = False

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
        attn = Qwen3Attention(arch, context, rotary, attn_backend, prefix=f"{prefix}.self_attn")
        if not moe.is_moe_layer(index):
            return attn, None
        return attn, SparseMoeBlock(arch, moe, context, prefix=f"{prefix}.mlp")

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        return self.load_moe_weights(weights, super().load_weights)
