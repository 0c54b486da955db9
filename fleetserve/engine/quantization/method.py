"""The quant-method hook of the linear layers: a layer asks its method to create its weights,
to finish them after loading and to apply them.

`UnquantizedLinearMethod` is every layer's default: one `weight` parameter [out, in] in the
engine dtype and the device's dense GEMM (`fleetserve.engine.layers.gemm`). A method registers the parameters the checkpoint (or online quantization) provides under the layer;
the layer's sharded `load_weight` fills them by name, so a method's parameters must keep the
weight's row order (output rows on dim 0) and may pack the input dim by a whole factor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import nn

from fleetserve.engine.layers.gemm import DenseGemm

if TYPE_CHECKING:
    from fleetserve.engine.layers.linear import Linear

__all__ = ["LinearMethod", "UnquantizedLinearMethod", "param", "replace_parameter"]


class LinearMethod(ABC):
    """How one linear layer stores and applies its weight."""

    name: str = "unquantized"

    @abstractmethod
    def create_weights(self, layer: Linear, dtype: torch.dtype, device: torch.device) -> None:
        """Register the layer's weight parameter(s) for [layer.output_size, layer.input_size]
        (uninitialised; loading or dummy init fills them)."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Turn the loaded parameters into the ones `apply` reads (online quantization)."""
        del layer

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., input_size] → [..., output_size] in x's dtype."""


class UnquantizedLinearMethod(LinearMethod):
    """The engine dtype's weight and the device's dense GEMM (`fleetserve.engine.layers.gemm`:
    oneDNN on the CPU, `F.linear` elsewhere)."""

    gemm: DenseGemm
    """The layer's GEMM, chosen in `create_weights` for the weight's device and dtype."""

    def create_weights(self, layer: Linear, dtype: torch.dtype, device: torch.device) -> None:
        # NOTE: torch.empty, not nn.Linear: random init of a multi-GB model is pure waste.
        weight = torch.empty((layer.output_size, layer.input_size), dtype=dtype, device=device)
        replace_parameter(layer, "weight", weight)
        self.gemm = DenseGemm(device, dtype)

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.gemm.prepack(layer.weight, layer.bias)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.gemm(x, layer.weight, bias)


def replace_parameter(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    """Set (or replace) a frozen parameter `name` of `layer`, freeing the old tensor."""
    if name in layer._parameters:
        del layer._parameters[name]
    layer.register_parameter(name, nn.Parameter(value, requires_grad=False))


def param(layer: nn.Module, name: str) -> torch.Tensor:
    """The layer's parameter `name` (a method's own storage), typed for the method code."""
    value = layer._parameters[name]
    assert value is not None, f"{name} is not set"
    return value
