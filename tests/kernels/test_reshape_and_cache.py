"""reshape_and_cache writes exactly the mapped slots (-1 writes nothing), cast to the cache dtype."""

from __future__ import annotations

import pytest
import torch

from fleetserve.kernels.reference import reshape_and_cache_ref


@pytest.mark.parametrize(
    ("key_dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
)
def test_writes_mapped_slots_only(
    key_dtype: torch.dtype, cache_dtype: torch.dtype, device: torch.device
) -> None:
    from fleetserve.kernels.reshape_and_cache import reshape_and_cache

    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_size, num_tokens = 5, 4, 3, 32, 7
    # Slot 6 starts mid-block; two padded tokens (-1) must leave the (NaN) cache untouched.
    slots = torch.tensor([6, 7, 8, -1, 13, 2, -1], dtype=torch.int64, device=device)
    # A strided view (the engine passes slices of the fused qkv projection).
    kv = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_size, generator=gen).to(key_dtype)
    kv = kv.to(device)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads : 2 * num_kv_heads]
    cache = torch.full(
        (2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=cache_dtype
    ).to(device)
    expected = cache.clone()
    reshape_and_cache(key, value, cache, slots)
    reshape_and_cache_ref(key, value, expected, slots)
    torch.testing.assert_close(cache, expected, equal_nan=True, atol=0.0, rtol=0.0)
    flat = cache.view(2, num_blocks * block_size, -1)
    written = {6, 7, 8, 13, 2}
    untouched = [s for s in range(num_blocks * block_size) if s not in written]
    assert flat[:, untouched].isnan().all()
    assert not flat[:, sorted(written)].isnan().any()


def test_no_tokens_is_a_no_op(device: torch.device) -> None:
    from fleetserve.kernels.reshape_and_cache import reshape_and_cache

    cache = torch.zeros(2, 2, 4, 1, 32, device=device)
    empty = torch.zeros(0, 1, 32, device=device)
    reshape_and_cache(empty, empty, cache, torch.zeros(0, dtype=torch.int64, device=device))
    assert not cache.any()


@pytest.mark.gpu
def test_realistic_size_on_gpu() -> None:
    from fleetserve.kernels.reshape_and_cache import reshape_and_cache

    device = torch.device("cuda")
    num_blocks, block_size, num_kv_heads, head_size, num_tokens = 4096, 16, 8, 128, 8192
    key = torch.randn(num_tokens, num_kv_heads, head_size, device=device, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[::97] = -1
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, device=device)
    cache = cache.to(torch.bfloat16)
    expected = cache.clone()
    reshape_and_cache(key, value, cache, slots)
    reshape_and_cache_ref(key, value, expected, slots)
    torch.testing.assert_close(cache, expected, atol=0.0, rtol=0.0)
