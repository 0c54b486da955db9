"""A circuit breaker (pure state machine; the clock is injected so tests drive time).

closed --`failures` consecutive failures--> open --`cooldown_s` elapsed--> half-open
half-open: one trial at a time is allowed; its success closes the breaker, its failure opens it
again for another cooldown. The router keeps one per engine and one per (prefill, decode) pair.
What counts as a failure is the caller's contract: 5xx answers, timeouts and connection errors,
never a client's 4xx (`fleetserve.router.forward` classifies).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

__all__ = ["BreakerState", "CircuitBreaker"]

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """Counts consecutive failures; `allows()` says whether a request may go through now."""

    def __init__(
        self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        if not cooldown_s > 0:
            raise ValueError(f"cooldown_s must be > 0, got {cooldown_s}")
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._consecutive = 0
        self._opened_at: float | None = None
        self._trial_in_flight = False
        self.times_opened = 0
        """How often the breaker went from closed to open (ejections)."""

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return "closed"
        if self._clock() - self._opened_at >= self.cooldown_s:
            return "half_open"
        return "open"

    def available(self) -> bool:
        """Whether a request could go through now (without taking the half-open trial slot)."""
        state = self.state
        return state == "closed" or (state == "half_open" and not self._trial_in_flight)

    def acquire(self) -> bool:
        """Take permission for one request: always when closed; in half-open the single trial
        slot (False while another trial runs); never when open."""
        state = self.state
        if state == "closed":
            return True
        if state == "half_open" and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        return False

    def record_success(self) -> None:
        """A request (or probe) through this breaker succeeded: close it."""
        self._consecutive = 0
        self._opened_at = None
        self._trial_in_flight = False

    def record_failure(self) -> bool:
        """A request through this breaker failed. Returns True if this failure opened it (from
        closed: an ejection); a failed half-open trial re-opens it for a new cooldown."""
        self._consecutive += 1
        if self._opened_at is not None:
            if self.state != "open" or self._trial_in_flight:
                self._opened_at = self._clock()
            self._trial_in_flight = False
            return False
        if self._consecutive >= self.failures:
            self._opened_at = self._clock()
            self.times_opened += 1
            return True
        return False

    def release(self) -> None:
        """A request that took the trial slot ended with neither success nor failure (the
        client went away, or the engine answered 429): free the slot for the next trial."""
        self._trial_in_flight = False
