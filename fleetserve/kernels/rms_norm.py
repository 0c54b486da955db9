"""RMSNorm with an optional fused residual add, matching the engine's `RMSNorm` rounding.

One program per row. Without a residual: `out = weight * (x * rsqrt(mean(x^2) + eps))`, the
normalised value rounded to the activation dtype before the weight multiply (as Hugging Face
does). With a residual the row is first summed, `s = x + residual` (rounded to the activation
dtype, where the engine adds), and the kernel returns both the normalised `s` and `s` itself, so
a decoder layer reads the hidden state once and writes two outputs instead of running an add
kernel and a norm kernel. Memory: read 2 (or 3) rows, write 1 (or 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_rows, hidden] normalised output
    residual_out_ptr,  # [num_rows, hidden] x + residual (HAS_RESIDUAL)
    x_ptr,  # [num_rows, hidden] input, last dim contiguous
    residual_ptr,  # [num_rows, hidden] residual stream (HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    stride_x_row,
    stride_residual_row,
    stride_out_row,
    stride_residual_out_row,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,  # >= HIDDEN, power of 2
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual_row + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out_row + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / HIDDEN + eps)
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out_row + cols,
        (weight * normed).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [num_rows, hidden]; with `residual`, also the summed residual stream.

    Args:
        x: [num_rows, hidden], last dim contiguous.
        weight: [hidden], contiguous.
        eps: variance epsilon.
        residual: optional [num_rows, hidden] in x's dtype.
        out, residual_out: optional preallocated outputs (may alias x / residual: each row is
            read before it is written).

    Returns:
        normed [num_rows, hidden] (dtype promoted between x and weight, like the engine), or
        (normed(x + residual), x + residual) when `residual` is given.
    """
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [num_rows, hidden], last dim contiguous"
    num_rows, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous(), "weight must be [hidden]"
    assert weight.device == x.device, "x and weight on different devices"
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == out_dtype and out.stride(1) == 1, "bad out"
    has_residual = residual is not None
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1, "residual must be like x"
        assert residual.dtype == x.dtype, "residual dtype must equal x's"
        if residual_out is None:
            residual_out = torch.empty_like(x)
        assert residual_out.shape == x.shape and residual_out.stride(1) == 1, "bad residual_out"
    else:
        residual, residual_out = x, out  # unused when HAS_RESIDUAL is False
    if num_rows > 0:
        _rms_norm_kernel[(num_rows,)](
            out,
            residual_out,
            x,
            residual,
            weight,
            x.stride(0),
            residual.stride(0),
            out.stride(0),
            residual_out.stride(0),
            eps,
            HIDDEN=hidden,
            BLOCK=triton.next_power_of_2(hidden),
            HAS_RESIDUAL=has_residual,
        )
    return (out, residual_out) if has_residual else out
