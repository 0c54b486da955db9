"""DeepSeek-V3: multi-head latent attention (MLA) and sigmoid-scored, group-limited MoE.

Attention as Hugging Face defines it: queries through a low-rank bottleneck (`q_a_proj` →
`q_a_layernorm` → `q_b_proj`, or one `q_proj` when `q_lora_rank` is null); keys and values
from one compressed latent (`kv_a_proj_with_mqa` gives the `kv_lora_rank` latent and a single
shared RoPE key of `qk_rope_head_dim`; `kv_a_layernorm`, then `kv_b_proj` expands the latent to
each head's non-rotary key (`qk_nope_head_dim`) and value (`v_head_dim`)). RoPE applies to the
last `qk_rope_head_dim` dims of queries and keys only; DeepSeek stores them interleaved
(`rope_interleave`), which is the neox rotation after gathering the even then the odd dims.

KV cache: this engine caches each head's decompressed key (nope + rope dims) and value, V
zero-padded to the key's head size, in the ordinary paged cache (`ModelArch` sizes it so); the
latent cache of the MLA paper is not built. Softmax scale: qk_head_dim^-0.5, times mscale² under
YaRN with `mscale_all_dim`, as HF does.

MLP: the first `first_k_dense_replace` layers are dense; the others are `SparseMoeBlock`s with
the router in float32, sigmoid scores plus `e_score_correction_bias` for the choice, grouped
top-k (`n_group`, `topk_group`), `routed_scaling_factor` and `n_shared_experts` shared experts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.engine.layers.attention.base import AttentionBackend
from fleetserve.engine.layers.attention.layer import Attention
from fleetserve.engine.layers.forward_context import ForwardContext
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.linear import (
    CheckpointTensor,
    ColumnParallelLinear,
    Linear,
    RowParallelLinear,
)
from fleetserve.engine.layers.norm import RMSNorm
from fleetserve.engine.layers.rotary import RotaryEmbedding
from fleetserve.engine.models.arch import ModelArch
from fleetserve.engine.models.llama import LlamaForCausalLM
from fleetserve.engine.models.moe_arch import MoeArch
from fleetserve.engine.models.moe_block import MoeModelMixin, SparseMoeBlock


def _config_int(arch: ModelArch, key: str) -> int:
    value = arch.hf_config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json {key!r} must be a positive integer, got {value!r}")
    return value


def mla_softmax_scale(arch: ModelArch, qk_head_dim: int) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)² under YaRN (HF's rule)."""
    scale = qk_head_dim**-0.5
    rope = arch.rope
    if rope.rope_type != "default" and rope.mscale_all_dim and rope.factor and rope.factor > 1:
        mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= mscale * mscale
    return scale


class DeepseekV3Attention(nn.Module):
    """MLA of one layer; heads split over the tensor-parallel ranks."""

    def __init__(
        self,
        arch: ModelArch,
        context: LayerContext,
        backend_cls: type[AttentionBackend],
        max_position: int,
        *,
        prefix: str,
    ) -> None:
        super().__init__()
        config = arch.hf_config
        hidden, heads = arch.hidden_size, arch.num_attention_heads
        if heads % context.tp_size != 0:
            raise ValueError(
                f"num_attention_heads ({heads}) must be divisible by tensor_parallel_size "
                f"({context.tp_size})"
            )
        self.num_heads = heads // context.tp_size
        self.nope = _config_int(arch, "qk_nope_head_dim")
        self.rope_dim = _config_int(arch, "qk_rope_head_dim")
        self.v_head = _config_int(arch, "v_head_dim")
        self.kv_lora_rank = _config_int(arch, "kv_lora_rank")
        self.qk_head = self.nope + self.rope_dim
        if self.v_head > self.qk_head:
            raise ValueError(
                f"config.json 'v_head_dim' ({self.v_head}) must be <= qk_nope_head_dim + "
                f"qk_rope_head_dim ({self.qk_head}): V is cached padded to the key head size"
            )
        self.interleaved = bool(config.get("rope_interleave", True))
        bias = arch.attention_bias
        q_lora = config.get("q_lora_rank")
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        if q_lora:
            q_lora = _config_int(arch, "q_lora_rank")
            self.q_a_proj = Linear(hidden, q_lora, context, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora, 1e-6, context)
            self.q_b_proj = ColumnParallelLinear.merged(
                q_lora, [heads * self.qk_head], context, bias=False
            )
        else:
            self.q_proj = ColumnParallelLinear.merged(
                hidden, [heads * self.qk_head], context, bias=False
            )
        self.kv_a_proj_with_mqa = Linear(
            hidden, self.kv_lora_rank + self.rope_dim, context, bias=bias
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6, context)
        self.kv_b_proj = ColumnParallelLinear.merged(
            self.kv_lora_rank, [heads * (self.nope + self.v_head)], context, bias=False
        )
        self.o_proj = RowParallelLinear(heads * self.v_head, hidden, context, bias=bias)
        self.rotary = RotaryEmbedding(arch.rope, self.rope_dim, max_position, context)
        self.attn = Attention(
            self.num_heads,
            self.num_heads,
            self.qk_head,
            backend_cls=backend_cls,
            layer_name=f"{prefix}.attn",
            scale=mla_softmax_scale(arch, self.qk_head),
        )

    def _deinterleave(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: DeepSeek rotates pairs (x0, x1), (x2, x3), ...; gathering the even dims then the
        # odd ones turns that into the neox (half-split) rotation, for queries and keys alike.
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if self.interleaved else x

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, context: ForwardContext
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        if self.q_a_proj is not None:
            assert self.q_a_layernorm is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        else:
            q = self.q_proj(hidden_states)
        q = q.view(num_tokens, self.num_heads, self.qk_head)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1
        )
        kv = self.kv_b_proj(self.kv_a_layernorm(latent.contiguous()))
        k_nope, v = kv.view(num_tokens, self.num_heads, self.nope + self.v_head).split(
            [self.nope, self.v_head], dim=-1
        )
        q_rot, k_rot = self.rotary(
            positions,
            self._deinterleave(q_rot).contiguous(),
            self._deinterleave(k_rot).reshape(num_tokens, 1, self.rope_dim).contiguous(),
        )
        query = torch.cat((q_nope, q_rot), dim=-1)
        key = torch.cat((k_nope, k_rot.expand(num_tokens, self.num_heads, self.rope_dim)), dim=-1)
        value = F.pad(v, (0, self.qk_head - self.v_head))
        out = self.attn(query, key, value, context)[..., : self.v_head]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_head))


class DeepseekV3ForCausalLM(MoeModelMixin, LlamaForCausalLM):
    """DeepSeek-V3-style causal LM (MLA attention, dense first layers, grouped-routed MoE)."""

    uses_sliding_window_by_default = False

    def __init__(
        self,
        arch: ModelArch,
        context: LayerContext,
        *,
        attn_backend: type[AttentionBackend],
        max_position: int,
    ) -> None:
        self._max_position = max_position
        super().__init__(arch, context, attn_backend=attn_backend, max_position=max_position)

    def decoder_layer_parts(
        self,
        arch: ModelArch,
        context: LayerContext,
        attn_backend: type[AttentionBackend],
        index: int,
        rotary: RotaryEmbedding,
        prefix: str,
    ) -> tuple[nn.Module | None, nn.Module | None]:
        attn = DeepseekV3Attention(
            arch, context, attn_backend, self._max_position, prefix=f"{prefix}.self_attn"
        )
        moe = MoeArch.from_hf_config(arch.hf_config)
        if not moe.is_moe_layer(index):
            return attn, None
        block = SparseMoeBlock(
            arch, moe, context, prefix=f"{prefix}.mlp", shared_name="shared_experts",
            router_fp32=True,
        )  # fmt: skip
        return attn, block

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        return self.load_moe_weights(weights, super().load_weights)
