"""Which expert-GEMM implementation a model's MoE layers use (as the attention selector does)."""

from __future__ import annotations

import torch

from fleetserve.kernels import is_interpreter

__all__ = ["select_moe_backend"]

_CHOICES: tuple[str, ...] = ("auto", "torch", "triton")


def select_moe_backend(requested: str, device: torch.device) -> str:
    """'torch' or 'triton' for `requested` ('auto': the Triton kernel on CUDA, torch on the CPU).

    Raises:
        ValueError: an unknown name, or 'triton' on the CPU outside Triton's interpreter.
    """
    if requested not in _CHOICES:
        raise ValueError(f"moe_backend must be one of {_CHOICES}, got {requested!r}")
    if requested == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if requested == "triton" and device.type != "cuda" and not is_interpreter():
        raise ValueError(
            "moe_backend 'triton' runs on device 'cpu' only in Triton's interpreter "
            "(set TRITON_INTERPRET=1), or use moe_backend 'torch'"
        )
    return requested
