"""Linear layers whose weights are allocated uninitialised and loaded shard by shard from files.

Tensor parallelism splits them as Megatron does:

- `ColumnParallelLinear` keeps some output rows of each (possibly fused) projection: q/k/v and
  gate/up are one matmul, and each rank computes its slice of the output; no communication.
- `RowParallelLinear` keeps the matching input columns; each rank's partial product is summed
  over the tensor-parallel group (the one all-reduce after attention and after the MLP), and
  the bias is added once, after the sum.

Which rows a rank keeps is a `RowSlice` per fused part: an even split (`split_evenly`), or for
the K/V heads of a model with fewer KV heads than ranks, the one head this rank's query heads
read (`qkv_slices`: KV heads are replicated). Loading reads only those rows (or columns) of the
checkpoint tensor (`CheckpointTensor.narrow`: a safetensors slice), so no rank materialises a
tensor it does not own. With one rank every layer is the plain single-device one.

How a layer stores and applies its weight is its quant method
(`fleetserve.engine.quantization.method`): unquantized (one `weight` in the engine dtype,
`F.linear`) unless `set_quant_method` gives it another after construction. A method's parameters
keep the weight's output rows on dim 0 and may pack the input dim by a whole factor, so the same
row and column slicing loads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.quantization.method import LinearMethod, UnquantizedLinearMethod

__all__ = [
    "CheckpointTensor",
    "ColumnParallelLinear",
    "Linear",
    "RowParallelLinear",
    "RowSlice",
    "copy_checked",
    "num_kv_heads_per_rank",
    "qkv_slices",
    "split_evenly",
]


class CheckpointTensor(Protocol):
    """A checkpoint tensor that can be read in part (a torch.Tensor is one too)."""

    @property
    def shape(self) -> torch.Size: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, start + length), as a tensor."""
        ...


@dataclass(frozen=True, slots=True)
class RowSlice:
    """The rows [start, start + size) of a checkpoint projection of `full` rows a rank keeps."""

    full: int
    start: int
    size: int


def split_evenly(full: int, rank: int, size: int, *, what: str) -> RowSlice:
    """Rank `rank`'s equal share of `full` rows.

    Raises:
        ValueError: `full` is not divisible by `size` (the message names `what`).
    """
    if full % size != 0:
        raise ValueError(f"{what} ({full}) must be divisible by tensor_parallel_size ({size})")
    share = full // size
    return RowSlice(full, rank * share, share)


def num_kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads each of `size` ranks holds: an even share, or one when they are replicated."""
    return max(1, num_kv_heads // size)


def qkv_slices(
    num_heads: int, num_kv_heads: int, head_size: int, rank: int, size: int
) -> tuple[RowSlice, RowSlice, RowSlice]:
    """The q, k and v rows of rank `rank` of `size`: query heads split evenly; KV heads split
    evenly when there are at least as many as ranks, else each rank keeps the one KV head its
    query heads attend with (KV heads replicated over size // num_kv_heads ranks).

    Raises:
        ValueError: heads that do not divide (or are not divided by) the rank count.
    """
    q = split_evenly(num_heads * head_size, rank, size, what="num_attention_heads × head_dim")
    if num_heads % size != 0:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be divisible by tensor_parallel_size ({size})"
        )
    if num_kv_heads >= size:
        if num_kv_heads % size != 0:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) must be divisible by "
                f"tensor_parallel_size ({size}) when it is larger"
            )
        kv = split_evenly(num_kv_heads * head_size, rank, size, what="num_key_value_heads")
    else:
        if size % num_kv_heads != 0:
            raise ValueError(
                f"tensor_parallel_size ({size}) must be a multiple of num_key_value_heads "
                f"({num_kv_heads}) when it is larger"
            )
        head = rank // (size // num_kv_heads)
        kv = RowSlice(num_kv_heads * head_size, head * head_size, head_size)
    return q, kv, kv


def copy_checked(target: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """target.copy_(loaded) after checking the shapes.

    Raises:
        ValueError: the shapes differ (the message names the tensor).
    """
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(
            f"checkpoint tensor {name} has shape {tuple(loaded.shape)}, "
            f"expected {tuple(target.shape)}"
        )
    target.copy_(loaded)


def _parameter(shape: tuple[int, ...], context: LayerContext) -> nn.Parameter:
    # NOTE: torch.empty, not nn.Linear: random init of a multi-GB model is pure waste.
    return nn.Parameter(
        torch.empty(shape, dtype=context.dtype, device=context.device), requires_grad=False
    )


class Linear(nn.Module):
    """y = x W^T (+ b); W [output_size, input_size], replicated on every rank."""

    weight: nn.Parameter
    """Registered by the quant method (absent for methods that store it packed)."""

    def __init__(
        self, input_size: int, output_size: int, context: LayerContext, *, bias: bool
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.quant_method: LinearMethod = UnquantizedLinearMethod()
        self.quant_method.create_weights(self, context.dtype, context.device)
        self.bias: nn.Parameter | None = _parameter((output_size,), context) if bias else None

    def set_quant_method(
        self, method: LinearMethod, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Replace the weight's storage with `method`'s (before loading; the bias stays)."""
        self.quant_method = method
        method.create_weights(self, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def load_weight(
        self, param: nn.Parameter, loaded: CheckpointTensor, name: str, shard: int | None = None
    ) -> None:
        """Copy the whole checkpoint tensor into `param` (a replicated layer keeps it all)."""
        copy_checked(param.data, loaded.narrow(0, 0, loaded.shape[0]), name)


class ColumnParallelLinear(Linear):
    """Several projections of the same input fused along the output dim (q/k/v, gate/up), each
    keeping this rank's rows `slices[i]`; the output is this rank's slice (no communication).

    Args:
        input_size: the input width (not split).
        slices: per fused part, the rows this rank keeps of the checkpoint's projection.
    """

    def __init__(
        self, input_size: int, slices: list[RowSlice], context: LayerContext, *, bias: bool
    ) -> None:
        super().__init__(input_size, sum(s.size for s in slices), context, bias=bias)
        self.slices = list(slices)
        self.output_sizes = [s.size for s in slices]

    @classmethod
    def merged(
        cls, input_size: int, output_sizes: list[int], context: LayerContext, *, bias: bool
    ) -> ColumnParallelLinear:
        """Each of `output_sizes` split evenly over the context's tensor-parallel ranks."""
        rank, size = context.tp_rank, context.tp_size
        slices = [
            split_evenly(n, rank, size, what="a projection's output size") for n in output_sizes
        ]
        return cls(input_size, slices, context, bias=bias)

    def load_weight(
        self, param: nn.Parameter, loaded: CheckpointTensor, name: str, shard: int | None = None
    ) -> None:
        """Copy this rank's rows of fused part `shard` (0 when unfused) into `param`.

        Raises:
            ValueError: the checkpoint tensor's rows or columns do not match the part.
        """
        part = 0 if shard is None else shard
        row = self.slices[part]
        if loaded.shape[0] != row.full:
            raise ValueError(
                f"checkpoint tensor {name} has {loaded.shape[0]} rows, expected {row.full}"
            )
        start = sum(self.output_sizes[:part])
        target = param.data[start : start + row.size]
        copy_checked(target, loaded.narrow(0, row.start, row.size), name)


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T, + b once: W [output_size, input_size / tp] holds this
    rank's input columns; the input is this rank's slice (a column-parallel layer's output)."""

    def __init__(
        self, input_size: int, output_size: int, context: LayerContext, *, bias: bool
    ) -> None:
        self.columns = split_evenly(
            input_size, context.tp_rank, context.tp_size, what="a projection's input size"
        )
        super().__init__(self.columns.size, output_size, context, bias=bias)
        self.tp_group = context.tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, None)
        if self.tp_group is not None:
            out = self.tp_group.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out

    def load_weight(
        self, param: nn.Parameter, loaded: CheckpointTensor, name: str, shard: int | None = None
    ) -> None:
        """The weight's columns of this rank; the bias whole (it is added after the sum).

        A quant method's parameter whose columns pack (or group) the input by a factor
        (`param.shape[1]` = input columns / factor) is sliced by the same factor.
        """
        if param is self.bias or param.dim() != 2:
            super().load_weight(param, loaded, name)
            return
        cols = self.columns
        factor, rest = divmod(cols.size, param.shape[1])
        if rest or cols.start % factor:
            raise ValueError(
                f"{name}: this rank's {cols.size} input columns do not split into its "
                f"{param.shape[1]} packed columns"
            )
        full, start, size = cols.full // factor, cols.start // factor, param.shape[1]
        if len(loaded.shape) != 2 or loaded.shape[1] != full:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(loaded.shape)}, expected {full} columns"
            )
        copy_checked(param.data, loaded.narrow(1, start, size), name)
