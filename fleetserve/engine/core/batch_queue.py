"""Bookkeeping of the batches in flight when the engine core pipelines steps (PP > 1).

With pipeline parallelism the executor takes a step without waiting for its result
(`Executor.execute_model_async`), so that while the last stage computes batch N the first
stage already computes batch N + 1 (seed notes part 1 §2.14: non-blocking execution). Two
pieces of state follow a batch from submission to its result:

- `BatchQueue` (the engine core's): the submitted batches and their pending results, oldest
  first, bounded by the executor's `max_concurrent_batches`. Results are taken oldest first:
  every stage runs batches in submission order, so the oldest finishes first.
- `InFlightRequests` (the scheduler's): which `Request` objects each batch carries. A request
  in an in-flight batch has nothing to compute until that batch's sampled token returns, so
  the scheduler skips it; the result of a batch applies only to the very objects it carried
  (a request aborted and resubmitted under the same id meanwhile is another object). It also
  sizes the micro-batches: a batch takes an even share of the schedulable requests over the
  batch slots still free, so that a steady decode of R requests over P stages runs P batches
  of R / P instead of one batch of R (which would leave every stage but one idle).

Why reusing a freed block is safe while batches are in flight: every stage applies batches in
submission order and touches only its own layers' KV, so a block freed after batch N was
submitted (a preemption, an abort) is rewritten by batch N + 1 on each stage only after batch N
finished there; likewise a prefix hit in batch N + 1 on a block batch N fills reads it after it
was written.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetserve.engine.core.outputs import SchedulerOutput
from fleetserve.engine.request import Request

if TYPE_CHECKING:
    from fleetserve.engine.worker.executor import StepFuture

__all__ = ["BatchQueue", "InFlightBatch", "InFlightRequests"]


@dataclass(frozen=True, slots=True)
class InFlightBatch:
    """One submitted step: its schedule and the pending result of its execution."""

    scheduler_output: SchedulerOutput
    future: StepFuture


class BatchQueue:
    """The engine core's submitted batches, oldest first, at most `capacity` of them.

    Args:
        capacity: batches in flight at most (the executor's `max_concurrent_batches`, >= 1).

    Raises:
        ValueError: a capacity below 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._batches: deque[InFlightBatch] = deque()
        self.max_depth = 0
        """The most batches that were ever in flight at once (observability)."""

    def __len__(self) -> int:
        return len(self._batches)

    @property
    def full(self) -> bool:
        return len(self._batches) >= self.capacity

    def push(self, scheduler_output: SchedulerOutput, future: StepFuture) -> None:
        """Record a submitted step.

        Raises:
            RuntimeError: the queue is full (the caller must take the oldest result first).
        """
        if self.full:
            raise RuntimeError(f"batch queue full ({self.capacity} batches in flight)")
        self._batches.append(InFlightBatch(scheduler_output, future))
        self.max_depth = max(self.max_depth, len(self._batches))

    def pop_oldest(self) -> InFlightBatch:
        """The oldest submitted step, removed (its result is the next to arrive).

        Raises:
            IndexError: nothing is in flight.
        """
        return self._batches.popleft()


class InFlightRequests:
    """The scheduler's view of the in-flight batches: which requests each one carries.

    Args:
        capacity: batches in flight at most (the engine core's batch queue's capacity).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_batch: dict[int, tuple[SchedulerOutput, frozenset[Request]]] = {}
        """id(scheduler_output) → (the output, kept alive so that the id stays unique, and the
        requests it carries)."""
        self._requests: set[Request] = set()

    def __contains__(self, request: Request) -> bool:
        return request in self._requests

    def __len__(self) -> int:
        """Batches in flight."""
        return len(self._by_batch)

    def share(self, num_schedulable: int) -> int:
        """Requests the next batch may carry: `num_schedulable` (the requests not in flight
        that could be scheduled now) spread evenly over the batch slots still free (>= 1)."""
        free_slots = max(self.capacity - len(self._by_batch), 1)
        return max(1, -(-num_schedulable // free_slots))

    def add(self, scheduler_output: SchedulerOutput, requests: Iterable[Request]) -> None:
        """A batch carrying `requests` was scheduled (each request in at most one batch)."""
        carried = frozenset(requests)
        assert not carried & self._requests, "a request scheduled in two batches at once"
        self._by_batch[id(scheduler_output)] = (scheduler_output, carried)
        self._requests |= carried

    def complete(self, scheduler_output: SchedulerOutput) -> frozenset[Request]:
        """The batch's result arrived (or it was never submitted): its requests are released.

        Returns:
            The request objects the batch carried (empty for a batch that scheduled nobody).
        """
        entry = self._by_batch.pop(id(scheduler_output), None)
        if entry is None:
            assert not scheduler_output.num_scheduled_tokens, "completing an unknown batch"
            return frozenset()
        carried = entry[1]
        self._requests -= carried
        return carried
