"""RMSNorm with an optional fused residual add (the vLLM calling convention).

`norm(x)` returns the normalised tensor; `norm(x, residual)` first adds `x` to `residual` and
returns `(normed(x + residual), x + residual)`, so decoder layers carry the residual stream
without a separate add kernel per sub-block. With the context's custom op selected the fused
kernel (Triton's `fleetserve.kernels.rms_norm` on CUDA, `fleetserve.kernels.cpu` on the CPU) does
the add and the norm in one pass (one read, one write).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fleetserve.engine.layers.layer_context import LayerContext


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 like Hugging Face's LlamaRMSNorm."""

    def __init__(self, hidden_size: int, eps: float, context: LayerContext) -> None:
        super().__init__()
        self.eps = eps
        self.use_triton = context.use_custom_op("rms_norm")
        self.pieces = context.pieces
        self.kernels: tuple[Callable[..., Any], Callable[..., Any]] | None = None
        """(rms_norm, fused_add_rms_norm) with the custom op selected."""
        if self.use_triton:
            from fleetserve.kernels.custom_ops import custom_op

            self.kernels = (
                custom_op("rms_norm", context.device),
                custom_op("fused_add_rms_norm", context.device),
            )
        self.weight = nn.Parameter(
            torch.empty(hidden_size, dtype=context.dtype, device=context.device),
            requires_grad=False,
        )

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # NOTE: the compiled pieces (a step in their range) first, then the custom kernel.
        if self.pieces is not None and self.pieces.applies(x.shape[0]):
            normed: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
            normed = self.pieces.rms_norm(x, self.weight, self.eps, residual)
            return normed
        if self.kernels is not None:
            norm, add_norm = self.kernels
            if residual is None:
                out: torch.Tensor = norm(x, self.weight, self.eps)
                return out
            both: tuple[torch.Tensor, torch.Tensor] = add_norm(x, residual, self.weight, self.eps)
            return both
        if residual is None:
            return self._norm(x)
        # NOTE: the add happens in the activation dtype, exactly where HF adds the residual.
        summed = x + residual
        return self._norm(summed), summed
