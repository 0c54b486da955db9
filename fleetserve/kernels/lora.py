"""Batched LoRA: every token's LoRA term under its own slot's adapter, as a shrink + expand pair.

The result is `fleetserve.engine.lora.ops.lora_delta`'s: for token t with slot s = slots[t],
`delta[t] = (x[t] @ A[s]^T) @ B[s]` (A [slots, w, in], B [slots, w, out], transposed and
pre-scaled); a base-model token (slot -1, or any slot outside [0, slots)) gets exactly 0.

Unlike the masked torch path, each program reads only its token's slot (by index), so the work
is the token's own rank, not every slot's. Two launches:

- shrink, grid (T,): `xa[t] = x[t] @ A[s]^T`, [w] in float32 (zeros for a base-model token);
- expand, grid (T, out blocks): `delta[t, cols] = xa[t] @ B[s, :, cols]`, rounded to x's dtype.

Both accumulate in float32 (the operands are upcast before the products; no `tl.dot`, so the
interpreter's bf16 dot is never used). Grids and buffers depend only on T, nothing on the
slots' values, so a CUDA graph can replay a step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["lora_delta_triton"]

_TILE_ELEMENTS = 8192
"""The most elements of one program's [w, block] tile of A or B (bounds its registers)."""


@triton.jit
def _lora_shrink_kernel(
    xa_ptr,  # [T, W] float32, contiguous
    x_ptr,  # [T, K], last dim contiguous
    a_ptr,  # [S, W, K], contiguous
    slots_ptr,  # [T] int64
    stride_x_row,
    S: tl.constexpr,
    W: tl.constexpr,
    K: tl.constexpr,
    W_PAD: tl.constexpr,  # next power of 2 of W
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    valid = (slot >= 0) & (slot < S)
    slot = tl.where(valid, slot, 0)
    rows = tl.arange(0, W_PAD)
    row_mask = (rows < W) & valid
    a_base = a_ptr + slot * W * K
    acc = tl.zeros((W_PAD,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = (ks < K) & valid
        xk = tl.load(x_ptr + token * stride_x_row + ks, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(
            a_base + rows[:, None] * K + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(xa_ptr + token * W + rows, acc, mask=rows < W)


@triton.jit
def _lora_expand_kernel(
    out_ptr,  # [T, N], contiguous
    xa_ptr,  # [T, W] float32, contiguous
    b_ptr,  # [S, W, N], contiguous
    slots_ptr,  # [T] int64
    S: tl.constexpr,
    W: tl.constexpr,
    N: tl.constexpr,
    W_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    slot = tl.load(slots_ptr + token)
    valid = (slot >= 0) & (slot < S)
    slot = tl.where(valid, slot, 0)
    rows = tl.arange(0, W_PAD)
    row_mask = (rows < W) & valid
    xa = tl.load(xa_ptr + token * W + rows, mask=row_mask, other=0.0)
    b = tl.load(
        b_ptr + slot * W * N + rows[:, None] * N + cols[None, :],
        mask=row_mask[:, None] & col_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(xa[:, None] * b, axis=0)
    tl.store(out_ptr + token * N + cols, delta.to(out_ptr.dtype.element_ty), mask=col_mask)


def _block(width_pad: int, size: int) -> int:
    return max(16, min(triton.next_power_of_2(size), 128, _TILE_ELEMENTS // width_pad))


def lora_delta_triton(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
) -> torch.Tensor:
    """The LoRA term of every token under its own slot's adapter (`ops.lora_delta`'s contract).

    Args:
        x: [T, in] the layer's input (last dim contiguous).
        lora_a: [slots, w, in] the slots' A matrices, contiguous.
        lora_b: [slots, w, out] the slots' B matrices, transposed and pre-scaled, contiguous.
        token_slots: [T] int64, each token's slot, -1 for the base model.

    Returns:
        [T, out] in x's dtype (rows of base-model tokens are exactly zero).
    """
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [T, in], last dim contiguous"
    assert lora_a.dim() == 3 and lora_b.dim() == 3, "lora_a / lora_b must be [slots, w, *]"
    assert lora_a.is_contiguous() and lora_b.is_contiguous(), "lora_a / lora_b must be contiguous"
    num_tokens, in_features = x.shape
    num_slots, width, _ = lora_a.shape
    out_features = lora_b.shape[2]
    assert lora_a.shape[2] == in_features, f"lora_a takes in={lora_a.shape[2]}, x has {in_features}"
    assert lora_b.shape[:2] == (num_slots, width), "lora_b's [slots, w] must match lora_a's"
    assert token_slots.shape == (num_tokens,) and token_slots.dtype == torch.int64, "bad slots"
    assert token_slots.is_contiguous(), "token_slots must be contiguous"
    out = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or out_features == 0:
        return out
    if num_slots == 0 or width == 0 or in_features == 0:
        return out.zero_()
    xa = torch.empty(num_tokens, width, dtype=torch.float32, device=x.device)
    width_pad = triton.next_power_of_2(width)
    _lora_shrink_kernel[(num_tokens,)](
        xa,
        x,
        lora_a,
        token_slots,
        x.stride(0),
        S=num_slots,
        W=width,
        K=in_features,
        W_PAD=width_pad,
        BLOCK_K=_block(width_pad, in_features),
    )
    block_n = _block(width_pad, out_features)
    _lora_expand_kernel[(num_tokens, triton.cdiv(out_features, block_n))](
        out,
        xa,
        lora_b,
        token_slots,
        S=num_slots,
        W=width,
        N=out_features,
        W_PAD=width_pad,
        BLOCK_N=block_n,
    )
    return out
