"""Rotary position embedding applied in place to query and key (neox and gpt-j styles).

One program per token rotates all its query heads and key heads. Pair i (frequency i) is
`(x[i], x[i + rotary_dim / 2])` in neox style and `(x[2i], x[2i + 1])` in gpt-j style; both
become `(a cos - b sin, b cos + a sin)`, computed in float32 and rounded once. Dimensions past
`rotary_dim` (partial rotary) are left alone. The cos/sin tables are the engine's
`RotaryEmbedding` tables, `[max_position, rotary_dim]` with the frequencies duplicated in the two
halves; the kernel reads the first half. Memory: read and write (H + Hkv) * rotary_dim per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,  # [num_heads, head_size] of one token, last dim contiguous
    stride_head,
    cos,  # [HALF_PAD] float32
    sin,  # [HALF_PAD] float32
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)
    pairs = tl.arange(0, HALF_PAD)
    if IS_NEOX:
        first = pairs
        second = pairs + HALF
    else:
        first = 2 * pairs
        second = 2 * pairs + 1
    mask = (heads[:, None] < NUM_HEADS) & (pairs[None, :] < HALF)
    base = x_ptr + heads[:, None] * stride_head
    a = tl.load(base + first[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(base + second[None, :], mask=mask, other=0.0).to(tl.float32)
    out_a = a * cos[None, :] - b * sin[None, :]
    out_b = b * cos[None, :] + a * sin[None, :]
    tl.store(base + first[None, :], out_a.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + second[None, :], out_b.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    query_ptr,  # [num_tokens, num_heads, head_size], rotated in place
    key_ptr,  # [num_tokens, num_kv_heads, head_size], rotated in place
    positions_ptr,  # [num_tokens] int64
    cos_ptr,  # [max_position, rotary_dim], contiguous
    sin_ptr,  # [max_position, rotary_dim], contiguous
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    HALF: tl.constexpr = ROTARY_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    pairs = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + pos * ROTARY_DIM + pairs, mask=pairs < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * ROTARY_DIM + pairs, mask=pairs < HALF, other=0.0)
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    _rotate_heads(
        query_ptr + token * stride_q_token,
        stride_q_head,
        cos,
        sin,
        NUM_HEADS,
        HEADS_PAD,
        HALF,
        HALF_PAD,
        IS_NEOX,
    )
    _rotate_heads(
        key_ptr + token * stride_k_token,
        stride_k_head,
        cos,
        sin,
        NUM_KV_HEADS,
        KV_HEADS_PAD,
        HALF,
        HALF_PAD,
        IS_NEOX,
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, H, D] and key [T, Hkv, D] in place by their positions [T]; return both.

    Args:
        positions: [T] int64 token positions (< max_position).
        query, key: last dim contiguous; modified in place.
        cos_cache, sin_cache: [max_position, rotary_dim] (engine layout, halves duplicated).
        is_neox: neox (rotate-half) style, else gpt-j (interleaved) style.
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    rotary_dim = cos_cache.shape[1]
    assert key.shape == (num_tokens, num_kv_heads, head_size), "key must be [T, Hkv, D]"
    assert positions.shape == (num_tokens,) and positions.dtype == torch.int64, "positions [T]"
    assert query.stride(2) == 1 and key.stride(2) == 1, "query/key last dim must be contiguous"
    assert cos_cache.shape == sin_cache.shape, "cos/sin tables differ in shape"
    assert cos_cache.is_contiguous() and sin_cache.is_contiguous(), "tables must be contiguous"
    assert rotary_dim % 2 == 0 and rotary_dim <= head_size, f"bad rotary_dim {rotary_dim}"
    assert query.device == key.device == positions.device == cos_cache.device, "devices differ"
    if num_tokens > 0:
        _rotary_embedding_kernel[(num_tokens,)](
            query,
            key,
            positions,
            cos_cache,
            sin_cache,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEADS_PAD=triton.next_power_of_2(num_heads),
            KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            ROTARY_DIM=rotary_dim,
            HALF_PAD=triton.next_power_of_2(rotary_dim // 2),
            IS_NEOX=is_neox,
        )
    return query, key
