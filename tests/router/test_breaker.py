"""The circuit breaker's state machine, on a driven clock."""

from __future__ import annotations

import pytest

from fleetserve.router.breaker import CircuitBreaker


def test_opens_after_consecutive_failures_then_one_trial_then_closes() -> None:
    now = [0.0]
    b = CircuitBreaker(3, 10.0, clock=lambda: now[0])
    assert not b.record_failure() and not b.record_failure()
    b.record_success()  # a success resets the count
    assert [b.record_failure() for _ in range(3)] == [False, False, True]
    assert (b.state, b.available(), b.acquire(), b.times_opened) == ("open", False, False, 1)
    now[0] = 10.0
    assert b.state == "half_open" and b.available()
    assert b.acquire() and not b.acquire(), "one trial at a time"
    assert not b.available()
    b.record_failure()  # the trial failed: open for another cooldown
    assert b.state == "open" and b.times_opened == 1
    now[0] = 20.0
    assert b.acquire()
    b.release()  # the trial ended without an answer: the slot is free again
    assert b.acquire()
    b.record_success()
    assert b.state == "closed" and b.acquire() and b.acquire()


def test_failures_while_open_do_not_extend_it_but_a_half_open_failure_does() -> None:
    now = [0.0]
    b = CircuitBreaker(1, 5.0, clock=lambda: now[0])
    assert b.record_failure()
    now[0] = 4.0
    b.record_failure()  # a late failure of a request sent before it opened
    now[0] = 5.0
    assert b.state == "half_open"
    b.record_failure()  # e.g. the health probe failed again
    assert b.state == "open"
    now[0] = 9.9
    assert b.state == "open"
    now[0] = 10.0
    assert b.state == "half_open"


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="failures must be >= 1"):
        CircuitBreaker(0, 1.0)
    with pytest.raises(ValueError, match="cooldown_s must be > 0"):
        CircuitBreaker(1, 0.0)
