"""One pipeline stage's step: receive the previous stage's activations, run this stage's layers,
send them on.

A stage runs its steps in the order the executor submitted them and moves to the next one as
soon as it has sent its activations, so with several batches in flight (the engine core's batch
queue) stage 1 computes batch N while stage 2 computes batch N - 1; sends and receives between
two stages pair up in that same order.

What travels between stages is `IntermediateTensors`, the hidden states and the residual stream
of every token of the step, stacked into one [2, num_tokens, hidden] message over the pipeline
group's device channel. Every stage builds the same flat batch from the same `SchedulerOutput`,
so the receiver knows the shape without being told.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fleetserve.engine.distributed.group import GroupCoordinator

__all__ = ["IntermediateTensors", "PipelineStage"]


@dataclass(frozen=True, slots=True)
class IntermediateTensors:
    """A stage's output for the next stage: hidden states and residual [num_tokens, hidden]."""

    hidden_states: torch.Tensor
    residual: torch.Tensor


StageForward = Callable[[IntermediateTensors | None], "torch.Tensor | IntermediateTensors"]


class PipelineStage:
    """This rank's place in its pipeline group and the hand-off around its forward pass."""

    def __init__(
        self, group: GroupCoordinator, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.group = group
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device

    @property
    def is_last(self) -> bool:
        return self.group.is_last

    def run(self, num_tokens: int, forward: StageForward) -> torch.Tensor | None:
        """Run `forward` on what the previous stage sent (None on the first stage) and send its
        result on; returns the final hidden states on the last stage, None elsewhere.

        Raises:
            TypeError: the model returned the wrong kind of output for this stage.
        """
        intermediate = None
        if not self.group.is_first:
            buffer = torch.empty(
                2, num_tokens, self.hidden_size, dtype=self.dtype, device=self.device
            )
            self.group.recv(buffer, self.group.rank_in_group - 1)
            intermediate = IntermediateTensors(buffer[0], buffer[1])
        out = forward(intermediate)
        if self.group.is_last:
            if not isinstance(out, torch.Tensor):
                raise TypeError("the last pipeline stage must return hidden states")
            return out
        if not isinstance(out, IntermediateTensors):
            raise TypeError("a pipeline stage before the last must return IntermediateTensors")
        self.group.send(
            torch.stack([out.hidden_states, out.residual]), self.group.rank_in_group + 1
        )
        return None
