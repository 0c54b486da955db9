"""Waiting queues: FCFS (arrival order) and PRIORITY (lower value = more important, like vLLM)."""

from __future__ import annotations

import enum
import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from fleetserve.engine.request import Request


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(ABC):
    """The scheduler's WAITING/PREEMPTED requests, in admission order."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Enqueue a new request."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Put a preempted request back where it is admitted first (policy permitting)."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request to admit. Raises IndexError when empty."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the next request. Raises IndexError when empty."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Remove `request` (must be queued)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in admission order."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty request queue")
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Heap ordered by (priority, arrival_time, request_id); ties never compare requests."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, str, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, request.request_id, request)
        )

    def prepend(self, request: Request) -> None:
        # NOTE: a preempted request keeps its place by its own (priority, arrival) key; jumping
        # ahead of more important waiting requests would invert the policy.
        self.add(request)

    def peek(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty request queue")
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        for index, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[index] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id!r} is not in the queue")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()
