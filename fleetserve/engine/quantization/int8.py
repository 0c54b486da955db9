"""Online weight-only int8, one symmetric scale per output channel (runs on the CPU).

The checkpoint's weight is loaded in the engine dtype as usual; after loading each row is
quantized to int8 with scale = max|row| / 127 and the full-precision weight is freed. Each call
dequantizes the layer's weight into the activation dtype and multiplies (`x @ (q * scale)^T`,
exactly the reference), so at rest the weights take a quarter of fp32 and at most one layer's
full-precision copy exists at a time. torch's weight-only int8 kernel
(`torch._weight_int8pack_mm`) was the alternative; `fleetserve bench quant --matmul` times both
on the model's shapes, and on our 2-core CPU the kernel was many times slower at batch 8 and not
reliably faster at batch 1, so the method dequantizes (see docs/quantization.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fleetserve.engine.quantization.method import (
    LinearMethod,
    UnquantizedLinearMethod,
    param,
    replace_parameter,
)

if TYPE_CHECKING:
    from fleetserve.engine.layers.linear import Linear

__all__ = ["Int8WeightOnlyMethod", "dequantize_int8", "quantize_int8_per_channel"]


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], float32 scale [out]) with weight ≈ q * scale[:, None]."""
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference: q * scale per row, in `dtype`."""
    return (q.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


class Int8WeightOnlyMethod(LinearMethod):
    """int8 weight [out, in] + `weight_scale` [out] (the engine dtype)."""

    name = "int8_per_channel_weight_only"

    def create_weights(self, layer: Linear, dtype: torch.dtype, device: torch.device) -> None:
        # NOTE: loaded in full precision; quantized in process_weights_after_loading.
        UnquantizedLinearMethod().create_weights(layer, dtype, device)

    def process_weights_after_loading(self, layer: Linear) -> None:
        weight = layer.weight
        q, scale = quantize_int8_per_channel(weight.data)
        replace_parameter(layer, "weight", q)
        replace_parameter(layer, "weight_scale", scale.to(weight.dtype))

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q, scale = param(layer, "weight"), param(layer, "weight_scale")
        return F.linear(x, dequantize_int8(q, scale, x.dtype), bias)
