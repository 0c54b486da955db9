"""Write this step's keys and values into the paged KV cache through the slot mapping.

One program per token copies that token's `[num_kv_heads, head_size]` key and value tile to
cache slot `slot_mapping[token]` (block `slot // block_size`, offset `slot % block_size`).
Slot -1 marks a padded token: its program stores nothing. Memory traffic: read 2*T*Hkv*D
elements, write the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size], last dim contiguous
    value_ptr,  # [num_tokens, num_kv_heads, head_size], last dim contiguous
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size], contiguous
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size], contiguous
    slot_mapping_ptr,  # [num_tokens] int64, -1 = write nothing
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    # NOTE: a mask instead of an early return keeps the kernel branch-free; slot -1 is clamped to
    # 0 so the (never dereferenced) address stays inside the cache.
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_SIZE) & (slot >= 0)
    safe_slot = tl.maximum(slot, 0)
    k = tl.load(
        key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    v = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    cache_offsets = (
        safe_slot * (NUM_KV_HEADS * HEAD_SIZE) + heads[:, None] * HEAD_SIZE + dims[None, :]
    )
    tl.store(key_cache_ptr + cache_offsets, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offsets, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] in place.

    Args:
        key, value: this step's projections; cast to the cache dtype on store.
        kv_cache: one layer's cache, contiguous.
        slot_mapping: [T] int64 cache slots; -1 writes nothing.
    """
    num_tokens, num_kv_heads, head_size = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "kv_cache must be [2, N, B, Hkv, D]"
    assert kv_cache.shape[3:] == (num_kv_heads, head_size), "kv_cache heads/dims != key's"
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    assert key.stride(2) == 1 and value.stride(2) == 1, "key/value last dim must be contiguous"
    assert slot_mapping.shape == (num_tokens,), "slot_mapping must be [num_tokens]"
    assert slot_mapping.dtype == torch.int64, "slot_mapping must be int64"
    assert key.device == kv_cache.device == slot_mapping.device, "tensors on different devices"
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size),
    )
