"""Fused mixture-of-experts MLP: top-k routing, grouped GEMMs over experts, weighted combine.

Pipeline for hidden [T, K], gate/up weights w13 [E, 2I, K], down weights w2 [E, K, I]:
1. `select_experts`: softmax over the router logits, top-k experts per token (optionally
   renormalised weights). Tiny ([T, E]); done in torch.
2. `align_by_expert`: the T*k (token, expert) pairs sorted by expert, each expert's run padded
   to a multiple of BLOCK_M with a sentinel pair id, so every row block has one expert.
3. `_fused_moe_kernel` (grouped GEMM): one program per (row block, column block) multiplies the
   gathered rows by its expert's weight tile. Run once for gate/up (rows are tokens: pair // k),
   then SiLU-and-mul, then once for down (rows are pairs), scaling each row by its routing weight.
4. Combine: the k scaled rows of each token (float32) are summed, then cast once.
The padded and sentinel rows cost one masked tile at most per expert; experts with no tokens
cost nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fleetserve.kernels import is_interpreter
from fleetserve.kernels.silu_and_mul import silu_and_mul


@triton.jit
def _fused_moe_kernel(
    c_ptr,  # [num_pairs, N] output, one row per (token, expert) pair
    a_ptr,  # [num_pairs // ROW_DIV, K] input rows, last dim contiguous
    b_ptr,  # [num_experts, N, K] expert weights (Linear layout: out x in)
    sorted_pair_ids_ptr,  # [num_padded] int32 pair ids grouped by expert; >= num_pairs = pad
    block_expert_ptr,  # [num_padded // BLOCK_M] int32 expert of each row block
    topk_weights_ptr,  # [num_pairs] float32 routing weights (MUL_WEIGHT)
    num_pairs,
    N,
    K,
    stride_a_row,
    stride_b_expert,
    stride_b_n,
    stride_c_row,
    ROW_DIV: tl.constexpr,  # a row index = pair id // ROW_DIV (top_k for the first GEMM)
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # dots in float32 (interpreter, fp32 inputs)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 dots (no tf32 rounding), else the default
):
    block_m = tl.program_id(0)
    block_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + block_m).to(tl.int64)
    pair = tl.load(sorted_pair_ids_ptr + block_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    a_row = (pair // ROW_DIV).to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        a = tl.load(
            a_ptr + a_row[:, None] * stride_a_row + (k0 + ks)[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + expert * stride_b_expert + cols[None, :] * stride_b_n + (k0 + ks)[:, None],
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        weight = tl.load(topk_weights_ptr + pair, mask=row_mask, other=0.0)
        acc = acc * weight[:, None]
    tl.store(
        c_ptr + pair.to(tl.int64)[:, None] * stride_c_row + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: (weights [T, k] float32, expert ids [T, k] int32)."""
    weights, ids = torch.topk(router_logits.float().softmax(-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the flattened (token, expert) pairs by expert, each run padded to block_m rows.

    Pairs whose id is outside [0, num_experts) (another expert-parallel rank's experts) are
    left out: no row block computes them.

    Returns:
        sorted_pair_ids [num_blocks * block_m] int32 (padding = num_pairs) and
        block_expert [num_blocks] int32.
    """
    ids = topk_ids.flatten().to(torch.int64)
    num_pairs = ids.numel()
    # NOTE: foreign pairs go to an extra bucket past the last expert, which gets no blocks.
    flat = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    counts = torch.bincount(flat, minlength=num_experts + 1)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank_in_expert = (
        torch.arange(num_pairs, device=flat.device)
        - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    )
    padded[num_experts] = 0
    total = int(padded.sum())
    sorted_pair_ids = torch.full((total,), num_pairs, dtype=torch.int32, device=flat.device)
    local = sorted_experts < num_experts
    sorted_pair_ids[(padded_start[sorted_experts] + rank_in_expert)[local]] = order[local].to(
        torch.int32
    )
    block_expert = torch.repeat_interleave(
        torch.arange(num_experts, dtype=torch.int32, device=flat.device),
        padded[:num_experts] // block_m,
    )
    return sorted_pair_ids, block_expert


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    sorted_pair_ids: torch.Tensor,
    block_expert: torch.Tensor,
    topk_weights: torch.Tensor | None,
    num_pairs: int,
    row_div: int,
    block_m: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    n, k = b.shape[1], b.shape[2]
    # NOTE: zeros, not empty: pairs of other ranks' experts are never written, and the combine
    # sums every pair's row.
    c = torch.zeros(num_pairs, n, dtype=out_dtype or a.dtype, device=a.device)
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    if grid[0] == 0:
        return c
    upcast = is_interpreter() or a.dtype == torch.float32
    _fused_moe_kernel[grid](
        c,
        a,
        b,
        sorted_pair_ids,
        block_expert,
        topk_weights if topk_weights is not None else c,
        num_pairs,
        n,
        k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        ROW_DIV=row_div,
        MUL_WEIGHT=topk_weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast else "tf32",
    )
    return c


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU mixture of experts for hidden [T, K]; returns [T, K] in hidden's dtype.

    Args:
        hidden: [T, K], contiguous.
        w13: [E, 2I, K] gate rows then up rows per expert, contiguous.
        w2: [E, K, I], contiguous.
        router_logits: [T, E].
        top_k: experts per token (1 <= top_k <= E).
        renormalize: rescale each token's top-k weights to sum to 1.
        out: optional preallocated [T, K] output like `hidden`.
    """
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    assert w13.shape[2] == hidden_size and two_inter % 2 == 0, "w13 must be [E, 2I, K]"
    assert w2.shape == (num_experts, hidden_size, two_inter // 2), "w2 must be [E, K, I]"
    assert router_logits.shape == (num_tokens, num_experts), "router_logits must be [T, E]"
    assert 1 <= top_k <= num_experts, f"top_k must be in [1, {num_experts}], got {top_k}"
    assert hidden.is_contiguous() and w13.is_contiguous() and w2.is_contiguous(), "contiguous"
    assert hidden.dtype == w13.dtype == w2.dtype, "hidden and weights must share a dtype"
    assert hidden.device == w13.device == w2.device == router_logits.device, "devices differ"
    topk_weights, topk_ids = select_experts(router_logits, top_k, renormalize)
    return fused_experts(hidden, w13, w2, topk_weights, topk_ids, out=out)


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts' part of `fused_moe`, for routing chosen by the caller.

    Args:
        hidden: [T, K], contiguous.
        w13: [E, 2I, K]; w2: [E, K, I] (contiguous, hidden's dtype and device).
        topk_weights: [T, k] float32 routing weights.
        topk_ids: [T, k] expert ids; ids outside [0, E) (experts of other expert-parallel
            ranks) contribute nothing.
        out: optional preallocated [T, K] output like `hidden`.

    Returns:
        [T, K]: each token's sum of weight × expert(hidden) over its ids in [0, E).
    """
    num_tokens, hidden_size = hidden.shape
    num_experts = w13.shape[0]
    top_k = topk_ids.shape[1]
    assert topk_weights.shape == topk_ids.shape == (num_tokens, top_k), "ids must be [T, k]"
    assert w13.is_contiguous() and w2.is_contiguous() and hidden.is_contiguous(), "contiguous"
    num_pairs = num_tokens * top_k
    block_m = 16 if num_pairs <= 64 * num_experts else 64
    sorted_pair_ids, block_expert = align_by_expert(topk_ids, num_experts, block_m)
    gate_up = _grouped_gemm(
        hidden, w13, sorted_pair_ids, block_expert, None, num_pairs, top_k, block_m
    )
    act = silu_and_mul(gate_up)
    down = _grouped_gemm(
        act,
        w2,
        sorted_pair_ids,
        block_expert,
        topk_weights.float().flatten().contiguous(),
        num_pairs,
        1,
        block_m,
        out_dtype=torch.float32,
    )
    if out is None:
        out = torch.empty_like(hidden)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype, "out must be like hidden"
    # NOTE: the weighted rows are float32; a token's k rows are summed before one rounding.
    return out.copy_(down.view(num_tokens, top_k, hidden_size).sum(dim=1))
