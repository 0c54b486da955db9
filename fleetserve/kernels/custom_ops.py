"""The fused kernels as torch custom ops (`torch.ops.fleetserve.*`), each with a fake (meta)
implementation, so `torch.compile` traces through them without graph breaks and FakeTensor
shape propagation needs no kernel.

| op                                  | real implementation              | mutates      |
|-------------------------------------|----------------------------------|--------------|
| `rms_norm(x, weight, eps)`          | `fleetserve.kernels.rms_norm`    | -            |
| `fused_add_rms_norm(x, residual, weight, eps)` → (normed, summed) | same | -           |
| `rotary_embedding(positions, query, key, cos, sin, is_neox)` | `kernels.rotary` | query, key |
| `silu_and_mul(x)`                   | `kernels.silu_and_mul`           | -            |
| `reshape_and_cache(key, value, kv_cache, slot_mapping)` | `kernels.reshape_and_cache` | kv_cache |

No op returns a tensor aliasing an input (torch forbids it): ops that work in place return
nothing and declare what they mutate. The real implementations are the Triton kernels on CUDA;
for CPU tensors the four switchable ops (all but `reshape_and_cache`) run the fused C++ kernels of
`fleetserve.kernels.cpu.ops` (float32; the torch reference elsewhere), since Triton runs on the
CPU only in its interpreter (the Triton kernels are tested there directly). The torch reference
of each (`reference.py`) is the engine's fallback when an op is not selected
(`fleetserve.engine.custom_ops`). The kernel modules are
imported lazily inside the implementations, so importing this module compiles nothing and works
on every platform.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "custom_op",
    "fused_add_rms_norm",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]


@torch.library.custom_op("fleetserve::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [rows, hidden] (the kernel's output dtype: x's promoted with weight's)."""
    from fleetserve.kernels.rms_norm import rms_norm as kernel

    out = kernel(x, weight, eps)
    assert isinstance(out, torch.Tensor)
    return out


@rms_norm.register_kernel("cpu")
def _rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from fleetserve.kernels.cpu import ops

    return ops.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("fleetserve::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed(x + residual), x + residual), both new tensors."""
    from fleetserve.kernels.rms_norm import rms_norm as kernel

    out = kernel(x, weight, eps, residual)
    assert isinstance(out, tuple)
    return out


@fused_add_rms_norm.register_kernel("cpu")
def _fused_add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from fleetserve.kernels.cpu import ops

    return ops.fused_add_rms_norm(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _fused_add_rms_norm_fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    normed = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return normed, torch.empty_like(x)


@torch.library.custom_op("fleetserve::rotary_embedding", mutates_args=("query", "key"))
def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Rotate query [T, H, D] and key [T, Hkv, D] in place by their positions."""
    from fleetserve.kernels.rotary import rotary_embedding as kernel

    kernel(positions, query, key, cos_cache, sin_cache, is_neox)


@rotary_embedding.register_kernel("cpu")
def _rotary_embedding_cpu(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    from fleetserve.kernels.cpu import ops

    ops.rotary_embedding(positions, query, key, cos_cache, sin_cache, is_neox)


@rotary_embedding.register_fake
def _rotary_embedding_fake(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    return None


@torch.library.custom_op("fleetserve::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] for x [rows, 2d] → [rows, d]."""
    from fleetserve.kernels.silu_and_mul import silu_and_mul as kernel

    return kernel(x)


@silu_and_mul.register_kernel("cpu")
def _silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    from fleetserve.kernels.cpu import ops

    return ops.silu_and_mul(x)


@silu_and_mul.register_fake
def _silu_and_mul_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op("fleetserve::reshape_and_cache", mutates_args=("kv_cache",))
def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter key/value [T, Hkv, D] into kv_cache [2, N, B, Hkv, D] at slot_mapping (-1: skip)."""
    from fleetserve.kernels.reshape_and_cache import reshape_and_cache as kernel

    kernel(key, value, kv_cache, slot_mapping)


@reshape_and_cache.register_fake
def _reshape_and_cache_fake(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    return None


def custom_op(name: str, device: torch.device) -> Callable[..., Any]:
    """The callable a layer calls for op `name` ('rms_norm', 'fused_add_rms_norm',
    'rotary_embedding', 'silu_and_mul') on `device`: the registered op (what torch.compile
    traces) on CUDA; on the CPU its implementation in `fleetserve.kernels.cpu.ops` directly,
    since the op wrapper's dispatch costs 10-40 µs a call there (more than the fused kernel of a
    decode step) and nothing compiles the whole model on the CPU.

    Raises:
        ValueError: an unknown op name.
    """
    ops = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul")
    if name not in ops:
        raise ValueError(f"name must be one of {ops}, got {name!r}")
    if device.type == "cpu":
        from fleetserve.kernels.cpu import ops as cpu_ops

        fn: Callable[..., Any] = getattr(cpu_ops, name)
        return fn
    op: Callable[..., Any] = globals()[name]
    return op
