"""Bounded admission: at most `max_in_flight` requests are forwarded at once, at most
`max_queued` wait for a slot (each at most `timeout_s`); beyond that the router answers 429 with
`Retry-After` instead of queueing without bound."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fleetserve.openai.errors import RequestError
from fleetserve.router.metrics import RouterMetrics

__all__ = ["Admission"]

RETRY_AFTER_S = 1


class Admission:
    """The in-flight limit and the admission queue (one per app, used on its event loop)."""

    def __init__(
        self, max_in_flight: int, max_queued: int, timeout_s: float, metrics: RouterMetrics
    ) -> None:
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.metrics = metrics
        self._slots = asyncio.Semaphore(max_in_flight)
        self.in_flight = 0
        self.queued = 0

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one in-flight slot for the body of the `async with`.

        Raises:
            RequestError: 429 with Retry-After when the queue is full or the wait timed out.
        """
        if self._slots.locked():
            if self.queued >= self.max_queued:
                raise RequestError(
                    429,
                    f"the router is at its limit ({self.max_in_flight} requests in flight,"
                    f" {self.queued} queued); retry later",
                    retry_after_s=RETRY_AFTER_S,
                )
            self.queued += 1
            self.metrics.queue_depth.set(self.queued)
            try:
                await asyncio.wait_for(self._slots.acquire(), self.timeout_s)
            except TimeoutError:
                raise RequestError(
                    429,
                    f"no in-flight slot freed within {self.timeout_s:g} s; retry later",
                    retry_after_s=RETRY_AFTER_S,
                ) from None
            finally:
                self.queued -= 1
                self.metrics.queue_depth.set(self.queued)
        else:
            await self._slots.acquire()
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        try:
            yield
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)
            self._slots.release()
