"""Shared builders for the kernel tests: random paged batches and per-dtype tolerances."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 2e-2,
}
"""atol = rtol per dtype: a few ulps of the dtype (fp32: accumulation-order differences)."""


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """assert_close within the dtype's tolerance; NaN anywhere (a poisoned output row) fails."""
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@dataclass
class PagedBatch:
    """A batch whose K/V (context and this step's tokens) are already in the cache."""

    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, this step's slots
    max_query_len: int


def make_paged_batch(
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> PagedBatch:
    """requests: (context_len, query_len) each. Blocks are shuffled; unused cache slots are NaN.

    Block 0 stays zero (the null block pads the block table, as in the engine).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + q) // block_size) for c, q in requests]
    num_blocks = sum(blocks_needed) + 2
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"))
    cache[:, 0] = 0.0
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(requests), max(blocks_needed) + 1, dtype=torch.int32)
    start_loc, slots = [0], []
    for i, (context_len, query_len) in enumerate(requests):
        ids = [order.pop() for _ in range(blocks_needed[i])]
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        seq_len = context_len + query_len
        for pos in range(seq_len):
            block, offset = ids[pos // block_size], pos % block_size
            cache[:, block, offset] = torch.randn(2, num_kv_heads, head_size, generator=gen)
            if pos >= context_len:
                slots.append(block * block_size + offset)
        start_loc.append(start_loc[-1] + query_len)
    query = torch.randn(start_loc[-1], num_heads, head_size, generator=gen)
    return PagedBatch(
        query=query.to(dtype=dtype, device=device),
        kv_cache=cache.to(dtype=dtype, device=device),
        query_start_loc=torch.tensor(start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([c + q for c, q in requests], dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(q for _, q in requests),
    )
