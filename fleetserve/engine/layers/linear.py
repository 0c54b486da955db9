"""Linear and embedding layers whose weights are allocated uninitialised and loaded from files.

`MergedLinear` stacks several HF projections (q/k/v, gate/up) into one matmul; the loader fills
each shard in place with `load_shard`. Tensor-parallel variants come later (they will take their
shard from the `LayerContext` every layer is built with); these are the single-rank blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.engine.layers.layer_context import LayerContext


class Linear(nn.Module):
    """y = x W^T (+ b); W [output_size, input_size]."""

    def __init__(
        self, input_size: int, output_size: int, context: LayerContext, *, bias: bool
    ) -> None:
        super().__init__()
        dtype, device = context.dtype, context.device
        self.input_size = input_size
        self.output_size = output_size
        # NOTE: torch.empty, not nn.Linear: random init of a multi-GB model is pure waste.
        self.weight = nn.Parameter(
            torch.empty(output_size, input_size, dtype=dtype, device=device), requires_grad=False
        )
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(output_size, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input fused along the output dim (e.g. q, k, v)."""

    def __init__(
        self, input_size: int, output_sizes: list[int], context: LayerContext, *, bias: bool
    ) -> None:
        super().__init__(input_size, sum(output_sizes), context, bias=bias)
        self.output_sizes = list(output_sizes)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        """Copy one projection's weight or bias into its rows of the fused parameter.

        Raises:
            ValueError: the checkpoint tensor's shape does not match the shard.
        """
        start = sum(self.output_sizes[:shard])
        target = param.data[start : start + self.output_sizes[shard]]
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(
                f"checkpoint shard {shard} has shape {tuple(loaded.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        target.copy_(loaded)


class Embedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int, context: LayerContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=context.dtype, device=context.device),
            requires_grad=False,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
