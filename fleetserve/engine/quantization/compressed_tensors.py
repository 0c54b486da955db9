"""The compressed-tensors `pack-quantized` linear method: int4/int8 weights packed in int32
words (`ct_scheme` describes the format), unpacked and dequantized per call in torch on any
device; the matmul is then the engine dtype's `F.linear`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fleetserve.engine.quantization.ct_scheme import CompressedTensorsScheme
from fleetserve.engine.quantization.method import LinearMethod, param, replace_parameter

if TYPE_CHECKING:
    from fleetserve.engine.layers.linear import Linear

__all__ = ["PackedIntMethod", "unpack_int32"]


def unpack_int32(packed: torch.Tensor, num_bits: int, columns: int) -> torch.Tensor:
    """Signed int8 [rows, columns] from the format's int32 words [rows, ceil(columns / f)]."""
    factor = 32 // num_bits
    mask = (1 << num_bits) - 1
    shifts = torch.arange(factor, device=packed.device, dtype=torch.int32) * num_bits
    # NOTE: bits >> of a negative int32 sign-extend; the mask keeps only the value's bits.
    values = (packed.unsqueeze(-1) >> shifts) & mask
    values = values.reshape(packed.shape[0], -1)[:, :columns]
    return (values - (1 << (num_bits - 1))).to(torch.int8)


class PackedIntMethod(LinearMethod):
    """`weight_packed` int32 + `weight_scale` (engine dtype), dequantized per call."""

    name = "compressed-tensors"

    def __init__(self, scheme: CompressedTensorsScheme) -> None:
        self.scheme = scheme

    def _group(self, layer: Linear) -> int:
        return layer.input_size if self.scheme.group_size is None else self.scheme.group_size

    def create_weights(self, layer: Linear, dtype: torch.dtype, device: torch.device) -> None:
        group = self._group(layer)
        if layer.input_size % group != 0:
            raise ValueError(
                f"compressed-tensors group_size ({group}) must divide the layer's input size "
                f"({layer.input_size})"
            )
        factor = self.scheme.pack_factor
        if layer.input_size % factor != 0:
            raise ValueError(
                f"a {self.scheme.num_bits}-bit packed layer's input size ({layer.input_size}) "
                f"must be a multiple of {factor}"
            )
        out, cols = layer.output_size, layer.input_size
        if "weight" in layer._parameters:
            del layer._parameters["weight"]
        packed = torch.empty((out, cols // factor), dtype=torch.int32, device=device)
        replace_parameter(layer, "weight_packed", packed)
        scale = torch.empty((out, cols // group), dtype=dtype, device=device)
        replace_parameter(layer, "weight_scale", scale)

    def dequantized_weight(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype`: q * the scale of its group."""
        q = unpack_int32(param(layer, "weight_packed"), self.scheme.num_bits, layer.input_size)
        group = self._group(layer)
        out = layer.output_size
        grouped = q.reshape(out, -1, group).to(torch.float32)
        scale = param(layer, "weight_scale").to(torch.float32).unsqueeze(-1)
        return (grouped * scale).reshape(out, layer.input_size).to(dtype)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(layer, x.dtype), bias)
