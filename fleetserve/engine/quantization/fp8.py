"""Online fp8 (e4m3) weights with one static scale per tensor.

On a CUDA GPU with fp8 tensor cores (compute capability 8.9 or newer) activations are quantized
per call with a dynamic per-tensor scale and multiplied by `torch._scaled_mm` (W8A8). Elsewhere
(the CPU, older GPUs) there is no fp8 matmul, so the method falls back, with the reason logged
once per process, to weight-only fp8: the fp8 weight is dequantized per call and multiplied in
the engine dtype. The fallback keeps the memory saving and the weights' fp8 rounding, so outputs
stay close to the GPU path, rather than refusing a model that would otherwise not fit.
"""

from __future__ import annotations

import logging
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

__all__ = ["FP8_MAX", "Fp8PerTensorMethod", "fp8_fallback_reason", "quantize_fp8_per_tensor"]

logger = logging.getLogger(__name__)

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""


def fp8_fallback_reason(device: torch.device) -> str | None:
    """Why W8A8 fp8 cannot run on `device` (None: it can)."""
    if device.type != "cuda":
        return f"device {device.type!r} has no fp8 matmul (torch._scaled_mm needs CUDA)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"GPU compute capability {major}.{minor} < 8.9 has no fp8 tensor cores"
    return None


def quantize_fp8_per_tensor(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn tensor, float32 scalar scale) with t ≈ q * scale."""
    t32 = t.to(torch.float32)
    scale = (t32.abs().amax().clamp(min=1e-12) / FP8_MAX).reshape(())
    q = (t32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


class Fp8PerTensorMethod(LinearMethod):
    """fp8 weight [out, in] + float32 `weight_scale` []; W8A8 where the device can."""

    name = "fp8_per_tensor"

    def __init__(self, device: torch.device) -> None:
        self.fallback_reason = fp8_fallback_reason(device)

    def create_weights(self, layer: Linear, dtype: torch.dtype, device: torch.device) -> None:
        UnquantizedLinearMethod().create_weights(layer, dtype, device)

    def process_weights_after_loading(self, layer: Linear) -> None:
        q, scale = quantize_fp8_per_tensor(layer.weight.data)
        replace_parameter(layer, "weight", q)
        replace_parameter(layer, "weight_scale", scale)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q, w_scale = param(layer, "weight"), param(layer, "weight_scale")
        if self.fallback_reason is not None:
            w = (q.to(torch.float32) * w_scale).to(x.dtype)
            return F.linear(x, w, bias)
        x2 = x.reshape(-1, x.shape[-1])
        xq, x_scale = quantize_fp8_per_tensor(x2)
        out = torch._scaled_mm(
            xq,
            q.t(),
            scale_a=x_scale,
            scale_b=w_scale,
            out_dtype=x.dtype,
        )
        out = out.reshape(*x.shape[:-1], q.shape[0])
        return out if bias is None else out + bias
