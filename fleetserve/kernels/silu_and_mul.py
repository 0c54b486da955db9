"""SiLU-and-mul: `silu(gate) * up` over the fused gate/up projection, in one pass.

Grid: (row, column block). The gate is the first half of each row, up the second half. The
SiLU is computed in float32 and rounded to the activation dtype before the multiply, exactly as
the engine's eager `F.silu(gate) * up` rounds. Memory: read 2*N*d elements, write N*d.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [num_rows, d], contiguous
    x_ptr,  # [num_rows, 2 * d], last dim contiguous (gate columns, then up columns)
    stride_x_row,
    D: tl.constexpr,
    BLOCK: tl.constexpr,  # columns per program, power of 2
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x_row + D + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] for x [num_rows, 2d] (last dim contiguous) into [num_rows, d].

    Args:
        x: gate columns, then up columns.
        out: optional preallocated contiguous [num_rows, d] output in x's dtype.
    """
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [num_rows, 2d], last dim contiguous"
    num_rows, width = x.shape
    assert width % 2 == 0, f"x's last dim must be even, got {width}"
    d = width // 2
    if out is None:
        out = torch.empty(num_rows, d, dtype=x.dtype, device=x.device)
    assert out.shape == (num_rows, d) and out.is_contiguous() and out.dtype == x.dtype, "bad out"
    block = min(1024, triton.next_power_of_2(d))
    if num_rows > 0:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(d, block))](
            out, x, x.stride(0), D=d, BLOCK=block
        )
    return out
