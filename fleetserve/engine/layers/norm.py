"""RMSNorm with an optional fused residual add (the vLLM calling convention).

`norm(x)` returns the normalised tensor; `norm(x, residual)` first adds `x` to `residual` and
returns `(normed(x + residual), x + residual)`, so decoder layers carry the residual stream
without a separate add kernel per sub-block. With the context's triton custom ops the fused kernel
of `fleetserve.kernels.rms_norm` does the add and the norm in one launch (one read, one write).
"""

from __future__ import annotations

import torch
from torch import nn

from fleetserve.engine.layers.layer_context import LayerContext


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 like Hugging Face's LlamaRMSNorm."""

    def __init__(self, hidden_size: int, eps: float, context: LayerContext) -> None:
        super().__init__()
        self.eps = eps
        self.use_triton = context.use_custom_op("rms_norm")
        self.pieces = None if self.use_triton else context.pieces
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
        if self.use_triton:
            from fleetserve.kernels import custom_ops

            if residual is None:
                return custom_ops.rms_norm(x, self.weight, self.eps)
            return custom_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if self.pieces is not None and self.pieces.applies(x.shape[0]):
            normed: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
            normed = self.pieces.rms_norm(x, self.weight, self.eps, residual)
            return normed
        if residual is None:
            return self._norm(x)
        # NOTE: the add happens in the activation dtype, exactly where HF adds the residual.
        summed = x + residual
        return self._norm(summed), summed
