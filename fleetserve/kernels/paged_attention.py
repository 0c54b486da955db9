"""Paged attention over a mixed batch (prefill chunks and decodes) in one launch.

Layout: requests lie back to back in the token dimension (`query_start_loc`, varlen); request i's
K/V live in the paged cache `[2, num_blocks, block_size, num_kv_heads, head_size]` at the blocks
`block_table[i]`. Query row j of a request with `query_len` rows sits at position
`seq_len - query_len + j` and attends causally to the positions before it (optionally only the
last `sliding_window` of them).

Grid: (request, query block, kv head x kv split). A program takes BLOCK_Q query tokens of one
request and all GROUP query heads that share one kv head (GQA), so the rows of its score tile are
(token, head-in-group) pairs and each K/V tile is loaded once for the whole group. It walks the
key range in tiles of TILE_N positions, gathering each position's slot through the block table
(any block size works), with an online softmax in float32.

Split-KV (long decodes): with NUM_SPLITS > 1 the key range of every program is cut into
NUM_SPLITS contiguous parts run by separate programs; each writes its normalised partial output
and log-sum-exp to a float32 scratch, and `_merge_splits_kernel` combines them. That keeps the GPU
busy when a decode batch has too few (request, kv head) pairs to fill it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fleetserve.kernels import is_interpreter

_LOG2_E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size] (NUM_SPLITS == 1)
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD] float32 (NUM_SPLITS > 1)
    partial_lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32, base-2 (NUM_SPLITS > 1)
    query_ptr,  # [num_tokens, num_heads, head_size], last dim contiguous
    key_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_size], contiguous
    value_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_size], contiguous
    query_start_loc_ptr,  # [num_reqs + 1] int32, prefix sums of query lengths
    seq_lens_ptr,  # [num_reqs] int32, context + query length
    block_table_ptr,  # [num_reqs, max_blocks] int32
    qk_scale,  # softmax scale * log2(e): scores are computed in base 2
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_block_table,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # >= GROUP, power of 2
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # >= HEAD_SIZE, power of 2
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (any value)
    BLOCK_Q: tl.constexpr,  # query tokens per program
    TILE_N: tl.constexpr,  # key positions per inner iteration
    SLIDING_WINDOW: tl.constexpr,  # 0 = no window
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,  # dots in float32: fp32 inputs, and the interpreter (bf16 dot is wrong)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 dots (no tf32 rounding), else the default
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    req = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + rows // GROUP_PAD  # token index within the request
    in_group = rows % GROUP_PAD
    head = kv_head * GROUP + in_group
    row_mask = (q_tok < query_len) & (in_group < GROUP)
    dims = tl.arange(0, HEAD_PAD)
    dim_mask = dims < HEAD_SIZE
    tok = (q_start + q_tok).to(tl.int64)  # row in the batch (int64: scratch offsets get large)
    q_offsets = tok[:, None] * stride_q_token + head[:, None] * stride_q_head
    q = tl.load(
        query_ptr + q_offsets + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context_len + q_tok

    # Key range of this query block: causal end, sliding-window start (aligned to TILE_N).
    kv_hi = context_len + tl.minimum((q_block + 1) * BLOCK_Q, query_len)
    kv_lo = 0
    if SLIDING_WINDOW > 0:
        kv_lo = tl.maximum(context_len + q_block * BLOCK_Q - SLIDING_WINDOW + 1, 0)
        kv_lo = (kv_lo // TILE_N) * TILE_N
    num_tiles = tl.cdiv(kv_hi - kv_lo, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    kv_stride: tl.constexpr = NUM_KV_HEADS * HEAD_SIZE
    for tile in range(tile_begin, tile_end):
        kv_pos = kv_lo + tile * TILE_N + tl.arange(0, TILE_N)
        kv_mask = kv_pos < kv_hi
        block = tl.load(
            block_table_ptr + req * stride_block_table + kv_pos // BLOCK_SIZE,
            mask=kv_mask,
            other=0,
        )
        slot = block.to(tl.int64) * BLOCK_SIZE + kv_pos % BLOCK_SIZE
        kv_base = slot * kv_stride + kv_head * HEAD_SIZE
        k = tl.load(
            key_cache_ptr + kv_base[None, :] + dims[:, None],
            mask=dim_mask[:, None] & kv_mask[None, :],
            other=0.0,
        )  # [HEAD_PAD, TILE_N]
        v = tl.load(
            value_cache_ptr + kv_base[:, None] + dims[None, :],
            mask=kv_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_PAD]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        allowed = kv_mask[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            allowed = allowed & (q_pos[:, None] - kv_pos[None, :] < SLIDING_WINDOW)
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # NOTE: a row with nothing allowed yet keeps m = -inf; shifting by 0 instead avoids
        # (-inf) - (-inf) = NaN while its probabilities stay exactly 0.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_offsets = tok[:, None] * stride_out_token + head[:, None] * stride_out_head
        tl.store(
            out_ptr + out_offsets + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & dim_mask[None, :],
        )
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        lse_offsets = (tok * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(partial_lse_ptr + lse_offsets, lse, mask=row_mask)
        tl.store(
            partial_out_ptr + lse_offsets[:, None] * HEAD_PAD + dims[None, :],
            out,
            mask=row_mask[:, None],
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD] float32
    partial_lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32, base 2
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    base = (token * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(partial_lse_ptr + base + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weights = tl.exp2(lse - lse_max)  # splits that saw no keys weigh 0
    parts = tl.load(
        partial_out_ptr + (base + splits)[:, None] * HEAD_PAD + dims[None, :],
        mask=(splits < NUM_SPLITS)[:, None],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_SIZE,
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def default_num_kv_splits(
    num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, device: torch.device
) -> int:
    """Split the key range only for decode-only batches that are too small to fill the GPU."""
    if device.type != "cuda" or max_query_len > 1 or max_seq_len < 1024:
        return 1
    num_sms = _num_sms(torch.cuda.current_device() if device.index is None else device.index)
    programs = num_reqs * num_kv_heads
    if programs >= num_sms:
        return 1
    return max(1, min(32, triton.cdiv(num_sms, programs), max_seq_len // 512))


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    max_seq_len: int = 0,
    sliding_window: int | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of a varlen batch against its cached K/V (already written).

    Args:
        query: [num_tokens, num_heads, head_size]; rows past `query_start_loc[-1]` are ignored.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size], contiguous.
        query_start_loc: [num_reqs + 1] int32 prefix sums of query lengths.
        seq_lens: [num_reqs] int32, context + query length per request.
        block_table: [num_reqs, max_blocks] int32.
        max_query_len: host-side max query length (sizes the grid).
        scale: softmax scale.
        max_seq_len: host-side max seq length (only used to choose the default split count).
        sliding_window: attend only to the last `sliding_window` positions (None = all).
        num_kv_splits: split-KV parts per program (None = `default_num_kv_splits`).
        out: optional preallocated output like `query`.

    Returns:
        [num_tokens, num_heads, head_size] in the query dtype; rows of padding tokens unspecified.
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    num_reqs = seq_lens.shape[0]
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "kv_cache must be [2, N, B, Hkv, D]"
    assert kv_cache.shape[4] == head_size, "kv_cache head_size != query's"
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert query.stride(2) == 1, "query last dim must be contiguous"
    assert query_start_loc.shape == (num_reqs + 1,), "query_start_loc must be [num_reqs + 1]"
    assert query_start_loc.dtype == seq_lens.dtype == block_table.dtype == torch.int32, "int32"
    assert block_table.shape[0] == num_reqs and block_table.stride(1) == 1, "bad block_table"
    assert query.device == kv_cache.device == block_table.device, "tensors on different devices"
    assert query.dtype == kv_cache.dtype, f"query {query.dtype} != kv_cache {kv_cache.dtype}"
    assert sliding_window is None or sliding_window > 0, "sliding_window must be positive"
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(2) == 1, "out must be like query"
    if num_reqs == 0 or max_query_len == 0:
        return out
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(
            num_reqs, num_kv_heads, max_query_len, max_seq_len, query.device
        )
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, min(64 // group_pad, triton.next_power_of_2(max_query_len)))
    # NOTE: tl.dot needs at least 16 rows on GPUs; pad the head group rather than the tokens.
    group_pad = max(group_pad, 16 // block_q)
    head_pad = triton.next_power_of_2(head_size)
    # NOTE: Triton's interpreter computes tl.dot on bf16 operands wrongly, so it gets float32.
    upcast = is_interpreter() or query.dtype == torch.float32
    if num_kv_splits > 1:
        partial_out = torch.empty(
            num_tokens, num_heads, num_kv_splits, head_pad, dtype=torch.float32, device=query.device
        )
        partial_lse = torch.empty(
            num_tokens, num_heads, num_kv_splits, dtype=torch.float32, device=query.device
        )
    else:
        partial_out = partial_lse = out  # unused by the kernel when NUM_SPLITS == 1
    grid = (num_reqs, triton.cdiv(max_query_len, block_q), num_kv_heads * num_kv_splits)
    flat_shape = (-1, num_kv_heads, head_size)
    _paged_attention_kernel[grid](
        out,
        partial_out,
        partial_lse,
        query,
        kv_cache[0].view(flat_shape),
        kv_cache[1].view(flat_shape),
        query_start_loc,
        seq_lens,
        block_table,
        scale * _LOG2_E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        TILE_N=32,
        SLIDING_WINDOW=sliding_window or 0,
        NUM_SPLITS=num_kv_splits,
        UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast else "tf32",
    )
    if num_kv_splits > 1:
        # NOTE: merging every row avoids a device sync for the real token count; padding rows
        # come out unspecified, as the contract allows.
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            partial_out,
            partial_lse,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            NUM_SPLITS=num_kv_splits,
            SPLITS_PAD=triton.next_power_of_2(num_kv_splits),
        )
    return out
