"""Delayed retries of handler work that failed (kopf's `TemporaryError` semantics, by hand).

The operator's handlers are `@kopf.on.event` handlers, which kopf never retries. kopf's retrying
handlers do not fit the operator's design: change handlers store progress and a diff base on the
object (writes on every pass, patch rights on the resource) and `@kopf.timer` adds a finalizer.
So the operator keeps at most one pending retry per key (one deployment's reconcile, one pod's
group restart): a daemon timer thread that re-runs the work after the delay
`fleetserve.operator.errors.retry_delay_s` picks, growing with each failed attempt. A success
cancels the pending retry and resets the count; `close()` cancels everything at shutdown. A
write into a namespace being deleted is not retried: the object goes away with it.

Work must be idempotent (the reconcile is level-based). Spec problems never reach here: the
reconcile turns them into phase Failed and returns normally.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable

from fleetserve.operator.errors import is_moot, is_transient, retry_delay_s

__all__ = ["Retries"]

logger = logging.getLogger(__name__)


class Retries:
    """Per-key delayed re-runs of failed work (thread-safe)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._timers: dict[str, threading.Timer] = {}
        self._attempts: dict[str, int] = {}
        self._later: dict[str, threading.Timer] = {}
        self._closed = False

    def run(
        self, key: str, work: Callable[[], None], *, again: Callable[[], None] | None = None
    ) -> None:
        """Run `work` now; if it raises, run `again` (default: `work`) for `key` after a delay.

        The exception is logged, not raised. Any retry already pending for `key` is replaced.
        A write refused because the namespace is being deleted is not retried (`is_moot`).
        """
        retry = again or work
        try:
            work()
        except Exception as exc:
            if is_moot(exc):
                logger.info("%s: its namespace is being deleted; nothing to retry", key)
                self.forget(key)
            else:
                self._schedule(key, retry, exc)
            return
        self.forget(key)

    def _schedule(self, key: str, work: Callable[[], None], exc: Exception) -> None:
        with self._guard:
            if self._closed:
                logger.warning("%s failed after shutdown began (%s); not retried", key, exc)
                return
            attempt = self._attempts.get(key, 0)
            self._attempts[key] = attempt + 1
            delay = retry_delay_s(exc, attempt)
            # NOTE: the copied context carries kopf's event queue, so the retry can post events.
            context = contextvars.copy_context()
            timer = threading.Timer(delay, context.run, (self.run, key, work))
            timer.daemon = True
            old = self._timers.pop(key, None)
            if old is not None:
                old.cancel()
            self._timers[key] = timer
            timer.start()
        if is_transient(exc):
            logger.warning("%s failed (%s); retry %d in %.1fs", key, exc, attempt + 1, delay)
        else:
            logger.error("%s failed; retry %d in %.1fs", key, attempt + 1, delay, exc_info=exc)

    def later(self, key: str, delay_s: float, work: Callable[[], None]) -> None:
        """Run `work` once after `delay_s` (not a retry: it has its own timers, so a success of
        the same key's work does not cancel it). A pending `later` of `key` is replaced."""
        with self._guard:
            if self._closed:
                return
            context = contextvars.copy_context()
            timer = threading.Timer(delay_s, context.run, (self._run_later, key, work))
            timer.daemon = True
            old = self._later.pop(key, None)
            if old is not None:
                old.cancel()
            self._later[key] = timer
            timer.start()

    def _run_later(self, key: str, work: Callable[[], None]) -> None:
        with self._guard:
            if self._later.get(key) is threading.current_thread():
                del self._later[key]
        work()

    def pending(self, key: str) -> bool:
        """True while a retry of `key` is scheduled."""
        with self._guard:
            timer = self._timers.get(key)
            return timer is not None and timer.is_alive()

    def forget(self, key: str) -> None:
        """Cancel a pending retry of `key` and reset its attempt count."""
        with self._guard:
            timer = self._timers.pop(key, None)
            self._attempts.pop(key, None)
        if timer is not None:
            timer.cancel()  # a no-op when it is the timer running this very retry

    def close(self) -> None:
        """Cancel every pending retry; later failures are logged and not retried."""
        with self._guard:
            self._closed = True
            timers = [*self._timers.values(), *self._later.values()]
            self._timers.clear()
            self._later.clear()
            self._attempts.clear()
        for timer in timers:
            timer.cancel()
