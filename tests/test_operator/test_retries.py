"""Retries: the delayed, per-key re-runs that give the operator's event handlers kopf's
TemporaryError semantics (real timers, real threads; delays from the error policy)."""

from __future__ import annotations

import contextvars
import itertools
import threading
import time

from kubernetes.client.exceptions import ApiException

from fleetserve.operator.errors import RETRY_DELAYS_S
from fleetserve.operator.retries import Retries
from tests.devcluster.helpers import poll

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR")


class Flaky:
    """Fails with a 503 `failures` times, then succeeds; records when it ran and what it saw."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[float] = []
        self.seen: list[str] = []
        self.done = threading.Event()

    def __call__(self) -> None:
        self.calls.append(time.monotonic())
        self.seen.append(VAR.get("unset"))
        if len(self.calls) <= self.failures:
            raise ApiException(status=503, reason="Service Unavailable")
        self.done.set()


def test_transient_failures_are_retried_with_growing_delays() -> None:
    retries = Retries()
    work = Flaky(failures=3)
    VAR.set("handler context")
    retries.run("k", work)
    assert len(work.calls) == 1 and retries.pending("k")
    assert work.done.wait(timeout=10)
    gaps = [b - a for a, b in itertools.pairwise(work.calls)]
    assert len(gaps) == 3
    for gap, delay in zip(gaps, RETRY_DELAYS_S, strict=False):
        assert delay * 0.95 <= gap < delay + 1.0, (gaps, RETRY_DELAYS_S)
    # The retry ran in a copy of the caller's context (kopf's event queue lives there).
    assert work.seen == ["handler context"] * 4
    poll("no retry pending after the success", lambda: not retries.pending("k"))
    time.sleep(RETRY_DELAYS_S[0] * 2)
    assert len(work.calls) == 4


def test_a_success_cancels_the_pending_retry_and_resets_the_delays() -> None:
    retries = Retries()
    work = Flaky(failures=1)
    retries.run("k", work)
    assert retries.pending("k")
    retries.run("k", lambda: None)  # e.g. a newer event's reconcile went through
    assert not retries.pending("k")
    time.sleep(RETRY_DELAYS_S[0] * 2)
    assert len(work.calls) == 1
    again = Flaky(failures=1)
    started = time.monotonic()
    retries.run("k", again)
    assert again.done.wait(timeout=5)
    assert again.calls[1] - started < RETRY_DELAYS_S[1]  # attempt 0's delay again


def test_the_retry_can_differ_from_the_first_run() -> None:
    retries = Retries()
    first = Flaky(failures=99)
    later = Flaky(failures=0)
    retries.run("k", first, again=later)
    assert later.done.wait(timeout=5)
    assert len(first.calls) == 1 and len(later.calls) == 1


def test_keys_are_independent_and_close_cancels_everything() -> None:
    retries = Retries()
    a, b = Flaky(failures=99), Flaky(failures=99)
    retries.run("a", a)
    retries.run("b", b)
    assert retries.pending("a") and retries.pending("b")
    retries.close()
    assert not retries.pending("a") and not retries.pending("b")
    time.sleep(RETRY_DELAYS_S[0] * 2)
    assert len(a.calls) == len(b.calls) == 1
    retries.run("a", a)  # after close: logged, not retried
    assert not retries.pending("a")


def test_work_in_a_terminating_namespace_is_not_retried() -> None:
    body = '{"details":{"causes":[{"reason":"NamespaceTerminating"}]}}'
    calls: list[int] = []

    def refused() -> None:
        calls.append(1)
        raise ApiException(status=403, reason="Forbidden", body=body)

    retries = Retries()
    retries.run("k", refused)
    assert not retries.pending("k")
    time.sleep(RETRY_DELAYS_S[0] * 2)
    assert calls == [1]
