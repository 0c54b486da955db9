"""The paged-attention kernel equals the float64 reference on mixed, odd-sized batches."""

from __future__ import annotations

import pytest
import torch

from fleetserve.kernels.reference import paged_attention_ref
from tests.kernels.helpers import assert_close, make_paged_batch

# (context_len, query_len): a chunk starting mid-block, a fresh prefill, 1-token decodes.
MIXED = [(5, 3), (0, 6), (9, 1), (3, 1)]


def _check(
    requests: list[tuple[int, int]],
    device: torch.device,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 32,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    num_kv_splits: int | None = None,
) -> None:
    from fleetserve.kernels.paged_attention import paged_attention

    batch = make_paged_batch(
        requests, num_heads, num_kv_heads, head_size, block_size, dtype, device
    )
    scale = head_size**-0.5
    out = torch.full_like(batch.query, float("nan"))
    result = paged_attention(
        batch.query,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        batch.max_query_len,
        scale,
        max_seq_len=int(batch.seq_lens.max()),
        sliding_window=sliding_window,
        num_kv_splits=num_kv_splits,
        out=out,
    )
    assert result is out
    expected = paged_attention_ref(
        batch.query,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        scale,
        sliding_window,
    )
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_batch_gqa(dtype: torch.dtype, device: torch.device) -> None:
    _check(MIXED, device, dtype=dtype)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_size", "block_size"),
    [(2, 2, 64, 16), (4, 1, 128, 8), (6, 2, 32, 16)],
)
def test_head_layouts(
    num_heads: int, num_kv_heads: int, head_size: int, block_size: int, device: torch.device
) -> None:
    """MHA at head size 64, GQA 4:1 at 128, a non-power-of-2 group (3) at 32."""
    _check(
        [(17, 2), (0, 5), (30, 1)],
        device,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
    )


def test_sliding_window(device: torch.device) -> None:
    _check([(37, 3), (0, 9), (21, 1)], device, sliding_window=5)


@pytest.mark.parametrize("num_kv_splits", [3, 4])
def test_split_kv_decode(num_kv_splits: int, device: torch.device) -> None:
    """Split-KV decodes, including splits that see no keys (seq 2 with 4 splits)."""
    _check([(70, 1), (1, 1), (40, 1)], device, num_kv_splits=num_kv_splits, block_size=16)


def test_split_kv_mixed_batch_with_window(device: torch.device) -> None:
    _check(MIXED, device, num_kv_splits=2, sliding_window=6)


def test_empty_batch_returns_output_untouched(device: torch.device) -> None:
    from fleetserve.kernels.paged_attention import paged_attention

    batch = make_paged_batch([(0, 1)], 2, 2, 32, 4, torch.float32, device)
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    out = paged_attention(
        batch.query[:0],
        batch.kv_cache,
        torch.zeros(1, dtype=torch.int32, device=device),
        empty,
        batch.block_table[:0],
        0,
        1.0,
    )
    assert out.shape == (0, 2, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [64, 128])
def test_realistic_sizes_on_gpu(dtype: torch.dtype, head_size: int) -> None:
    """32 query heads over 8 kv heads, 16-token blocks, long contexts, chunk + decodes."""
    requests = [(1000, 1), (517, 256), (0, 300), (4093, 1), (2048, 1), (33, 77)]
    _check(
        requests,
        torch.device("cuda"),
        num_heads=32,
        num_kv_heads=8,
        head_size=head_size,
        block_size=16,
        dtype=dtype,
    )


@pytest.mark.gpu
def test_split_kv_long_decode_on_gpu() -> None:
    requests = [(8191, 1), (5000, 1), (12, 1)]
    device = torch.device("cuda")
    for splits in (None, 8):
        _check(
            requests,
            device,
            num_heads=32,
            num_kv_heads=8,
            head_size=128,
            block_size=16,
            dtype=torch.bfloat16,
            num_kv_splits=splits,
        )
