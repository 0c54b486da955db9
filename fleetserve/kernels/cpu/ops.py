"""The CPU implementations of the switchable custom ops (`fleetserve.kernels.custom_ops`).

`custom_ops` registers these for CPU tensors: each runs the fused C++ kernel of
`elementwise.cpp` where it applies (float32 or bfloat16; contiguous rows;
whole-head neox rotary) and the op's torch reference (`fleetserve.kernels.reference`)
otherwise: float16, partial or gpt-j rotary, and a machine where the kernels could not be
built. Either way the contract is the op's.
"""

from __future__ import annotations

import torch

from fleetserve.kernels.cpu.build import load_cpu_kernels
from fleetserve.kernels.reference import rms_norm_ref, rotary_ref, silu_and_mul_ref

__all__ = [
    "fused_add_rms_norm",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "small_gemm_supported",
]


def _fused(*tensors: torch.Tensor) -> bool:
    """Whether the C++ kernels take these tensors: one dtype, float32 or bfloat16, with
    contiguous rows, kernels built."""
    dtype = tensors[0].dtype
    if not all(t.dtype == dtype and t.stride(-1) == 1 for t in tensors):
        return False
    return dtype in (torch.float32, torch.bfloat16) and load_cpu_kernels().available


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not (x.dim() == 2 and _fused(x, weight)):
        out = rms_norm_ref(x, weight, eps)
        assert isinstance(out, torch.Tensor)
        return out
    out = torch.empty_like(x)
    torch.ops.fleetserve_cpu.rms_norm(x, weight, eps, out)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if not (x.dim() == 2 and residual.shape == x.shape and _fused(x, residual, weight)):
        normed, summed = rms_norm_ref(x, weight, eps, residual)
        return normed, summed
    out, summed = torch.empty_like(x), torch.empty_like(x)
    torch.ops.fleetserve_cpu.fused_add_rms_norm(x, residual, weight, eps, out, summed)
    return out, summed


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    whole_heads = cos_cache.shape[-1] == query.shape[-1] == key.shape[-1]
    if is_neox and whole_heads and _fused(query, key, cos_cache, sin_cache):
        torch.ops.fleetserve_cpu.rotary_embedding(
            positions.to(torch.int64).contiguous(), query, key, cos_cache, sin_cache
        )
        return
    rotated_query, rotated_key = rotary_ref(positions, query, key, cos_cache, sin_cache, is_neox)
    query.copy_(rotated_query)
    key.copy_(rotated_key)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not (x.dim() == 2 and _fused(x)):
        return silu_and_mul_ref(x)
    out = x.new_empty((x.shape[0], x.shape[1] // 2))
    torch.ops.fleetserve_cpu.silu_and_mul(x, out)
    return out


def small_gemm_supported(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the small-row GEMM runs here for `dtype`: the kernels built, and float32 on a CPU
    with AVX-512 or AVX2 + FMA (`small_gemm.cpp`), bfloat16 on one with AMX-BF16
    (`small_gemm_bf16.cpp`) or with AVX2 only (`small_gemm.cpp`, the weight widened as read)."""
    if not load_cpu_kernels().available:
        return False
    if dtype == torch.float32:
        return bool(torch.ops.fleetserve_cpu.small_gemm_supported())
    if dtype == torch.bfloat16:
        return amx_gemm_supported() or bool(
            torch.ops.fleetserve_cpu.small_gemm_widen_bf16_supported()
        )
    return False


def amx_gemm_supported() -> bool:
    """Whether bfloat16 small-row GEMMs run on AMX tiles here (`small_gemm_bf16.cpp`)."""
    return load_cpu_kernels().available and bool(
        torch.ops.fleetserve_cpu.small_gemm_bf16_supported()
    )
