"""Gated activation of the fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.engine.layers.layer_context import LayerContext


class SiluAndMul(nn.Module):
    """`silu(x[..., :d]) * x[..., d:]` for x [..., 2d] (gate first, then up).

    With the context's triton custom ops, x must be 2-D and one fused kernel reads it once and
    writes the result.
    """

    def __init__(self, context: LayerContext) -> None:
        super().__init__()
        self.use_triton = context.use_custom_op("silu_and_mul")
        self.pieces = None if self.use_triton else context.pieces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from fleetserve.kernels.custom_ops import silu_and_mul

            return silu_and_mul(x)
        if self.pieces is not None and self.pieces.applies(x.shape[0]):
            out: torch.Tensor = self.pieces.silu_and_mul(x)
            return out
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
