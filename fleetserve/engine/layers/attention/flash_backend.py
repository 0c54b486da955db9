"""The flash-attn backend: FlashAttention-2's varlen kernel over K/V gathered from the paged cache.

NOTE: FlashAttention-2's own paged mode needs blocks of 256 tokens, larger than any block size
the engine allows, so this backend gathers each step's K/V into packed varlen tensors (one copy
per step) and calls `flash_attn_varlen_func`, whose causal mask is aligned bottom-right (the
cached context sits before the query rows). It is available only where `flash_attn` imports and
the model runs on CUDA; written against the flash-attn 2.x API and exercised by GPU tests only.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from fleetserve.engine.layers.attention.base import AttentionBackend
from fleetserve.engine.layers.attention.metadata import AttentionMetadata


class FlashAttentionBackend(AttentionBackend):
    """flash-attn 2 varlen attention (bf16/fp16 only, CUDA only)."""

    name = "flash_attn"
    supported_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
    supported_head_sizes: tuple[int, ...] | None = (32, 64, 96, 128, 256)
    supported_block_sizes: tuple[int, ...] | None = None

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_size)
        from flash_attn import flash_attn_varlen_func

        self._varlen: Any = flash_attn_varlen_func

    @classmethod
    def is_available(cls) -> str | None:
        if importlib.util.find_spec("flash_attn") is None:
            return "the flash_attn package is not installed"
        if not torch.cuda.is_available():
            return "flash_attn needs a CUDA device"
        return None

    @classmethod
    def validate_device(cls, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"flash_attn needs device 'cuda', got {device.type!r}"
        return None

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_tokens = metadata.num_actual_tokens
        output = torch.empty_like(query)
        slots, valid = metadata.kv_gather
        packed_slots = slots[valid]  # request-major, position order: the varlen K/V layout
        flat_shape = (-1, self.num_kv_heads, self.head_size)
        packed_k = kv_cache[0].view(flat_shape)[packed_slots]
        packed_v = kv_cache[1].view(flat_shape)[packed_slots]
        cu_seqlens_k = torch.zeros_like(metadata.query_start_loc)
        torch.cumsum(metadata.seq_lens, 0, out=cu_seqlens_k[1:])
        output[:num_tokens] = self._varlen(
            query[:num_tokens],
            packed_k,
            packed_v,
            metadata.query_start_loc,
            cu_seqlens_k,
            metadata.max_query_len,
            metadata.max_seq_len,
            softmax_scale=scale,
            causal=True,
        )
        return output
