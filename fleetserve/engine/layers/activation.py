"""Gated activation of the fused gate/up projection."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.engine.layers.layer_context import LayerContext


class SiluAndMul(nn.Module):
    """`silu(x[..., :d]) * x[..., d:]` for x [..., 2d] (gate first, then up).

    In a step the compiled pieces cover (`-O3` on the CPU) they run it; otherwise, with the
    context's custom op selected, x must be 2-D and one fused kernel (Triton on CUDA, C++ on the
    CPU) reads it once and writes the result.
    """

    def __init__(self, context: LayerContext) -> None:
        super().__init__()
        self.use_triton = context.use_custom_op("silu_and_mul")
        self.pieces = context.pieces
        self.kernel: Callable[[torch.Tensor], torch.Tensor] | None = None
        if self.use_triton:
            from fleetserve.kernels.custom_ops import custom_op

            self.kernel = custom_op("silu_and_mul", context.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pieces is not None and self.pieces.applies(x.shape[0]):
            out: torch.Tensor = self.pieces.silu_and_mul(x)
            return out
        if self.kernel is not None:
            return self.kernel(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
