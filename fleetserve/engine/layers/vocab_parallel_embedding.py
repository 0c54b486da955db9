"""Token embedding and LM head with the vocabulary split over the tensor-parallel ranks.

Each rank holds `ceil(vocab / tp)` consecutive rows of the table (the last rank's tail rows, past
the real vocabulary, are padding and stay zero). The embedding looks up the ids in its range,
zeroes the others and sums over the group (one all-reduce); the LM head computes its slice of
the logits and all-gathers them, so that every rank holds the full logits and samples the same
token (the seeded generators advance alike on every rank). With one rank both are the plain
single-device layers. The LM head shares the embedding's sharding, so tying them is sharing one
parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fleetserve.engine.layers.gemm import DenseGemm
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.linear import CheckpointTensor, copy_checked

__all__ = ["ParallelLMHead", "VocabParallelEmbedding"]


class VocabParallelEmbedding(nn.Module):
    """Token embedding [vocab_size, hidden_size], this rank's rows [vocab_start, vocab_end)."""

    def __init__(self, vocab_size: int, hidden_size: int, context: LayerContext) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // context.tp_size)
        self.vocab_start = min(context.tp_rank * self.rows_per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.tp_group = context.tp_group if context.tp_size > 1 else None
        self.weight = nn.Parameter(
            torch.zeros(
                self.rows_per_rank, hidden_size, dtype=context.dtype, device=context.device
            ),
            requires_grad=False,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = torch.where(outside, 0, input_ids - self.vocab_start)
        out = F.embedding(local, self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(out)

    def load_weight(
        self, param: nn.Parameter, loaded: CheckpointTensor, name: str, shard: int | None = None
    ) -> None:
        """This rank's rows of the [vocab_size, hidden] checkpoint table (padding stays zero).

        Raises:
            ValueError: the checkpoint table's shape differs from [vocab_size, hidden_size].
        """
        expected = (self.vocab_size, param.shape[1])
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(loaded.shape)}, expected {expected}"
            )
        rows = self.vocab_end - self.vocab_start
        copy_checked(param.data[:rows], loaded.narrow(0, self.vocab_start, rows), name)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection: hidden [n, hidden] → float32 logits [n, vocab_size] on every rank."""

    def __init__(self, vocab_size: int, hidden_size: int, context: LayerContext) -> None:
        super().__init__(vocab_size, hidden_size, context)
        self.gemm = DenseGemm(context.device, context.dtype)

    def prepack(self) -> None:
        """After loading (or tying): ready the weight for the device's GEMM."""
        self.gemm.prepack(self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("ParallelLMHead computes logits with compute_logits(), not forward()")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.gemm(hidden_states, self.weight, None)
        if self.tp_group is not None:
            logits = self.tp_group.all_gather(logits, dim=-1)
        return logits[:, : self.vocab_size].float()
