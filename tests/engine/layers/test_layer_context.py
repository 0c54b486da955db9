"""`LayerContext`: validated once, read by every layer."""

from __future__ import annotations

import pytest
import torch

from fleetserve.engine.layers.activation import SiluAndMul
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.linear import Linear
from fleetserve.engine.layers.norm import RMSNorm

CPU = torch.device("cpu")


def test_layers_take_dtype_device_and_custom_ops_from_the_context() -> None:
    context = LayerContext(torch.bfloat16, CPU, custom_ops="triton")
    assert context.use_triton_ops and (context.tp_rank, context.tp_size) == (0, 1)
    norm, linear = RMSNorm(8, 1e-6, context), Linear(8, 4, context, bias=True)
    assert norm.weight.dtype == linear.weight.dtype == torch.bfloat16
    assert linear.bias is not None and linear.bias.device == CPU
    assert norm.use_triton and SiluAndMul(context).use_triton
    assert not SiluAndMul(LayerContext(torch.float32, CPU)).use_triton


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"custom_ops": "cuda"}, r"custom_ops must be one of \('torch', 'triton'\), got 'cuda'"),
        ({"tp_size": 0}, "tp_size must be >= 1, got 0"),
        ({"tp_rank": 2, "tp_size": 2}, r"tp_rank must be in \[0, 2\), got 2"),
    ],
)
def test_bad_values_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LayerContext(torch.float32, CPU, **kwargs)  # type: ignore[arg-type]
