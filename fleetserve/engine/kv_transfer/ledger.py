"""The failure ledger: every transfer failure, with its stage, drained by the scheduler each step.

Any thread (a transport callback, the control channel, a handshake) may `report`; the connector's
scheduler role `drain`s once per step and applies the load-failure policy there, so failure
handling is one code path whatever failed. A request being loaded also has a deadline
(`watch`): when it passes without a completion or a failure, the watchdog reports a failure of
its own, so a missing report becomes a clean timeout instead of a request waiting forever.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

__all__ = ["FailureLedger", "RequestFailure", "TransferStage"]


class TransferStage(enum.Enum):
    HANDSHAKE = "handshake"
    REGISTRATION = "registration"
    SEND = "send"
    RECEIVE = "receive"
    WATCHDOG = "watchdog"


@dataclass(frozen=True, slots=True)
class RequestFailure:
    """One request's first KV-transfer failure, with its stage (the transport's own
    `TransferFailure` describes one transfer)."""

    key: str
    """The request's transfer id."""
    stage: TransferStage
    message: str


class FailureLedger:
    """Thread-safe: failures reported anywhere, drained by one consumer (the scheduler role)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: dict[str, RequestFailure] = {}
        self._deadlines: dict[str, float] = {}

    def report(self, key: str, stage: TransferStage, message: str) -> None:
        """Record a failure; the first one reported for a key wins (it is the cause)."""
        with self._lock:
            self._failures.setdefault(key, RequestFailure(key, stage, message))
            self._deadlines.pop(key, None)

    def watch(self, key: str, deadline: float) -> None:
        """Expect a completion or a failure for `key` before `deadline` (monotonic seconds)."""
        with self._lock:
            self._deadlines[key] = deadline

    def complete(self, key: str) -> None:
        """The transfer finished: stop watching it."""
        with self._lock:
            self._deadlines.pop(key, None)

    def drain(self, now: float) -> list[RequestFailure]:
        """Every failure since the last drain, including watchdog timeouts due at `now`."""
        with self._lock:
            for key, deadline in list(self._deadlines.items()):
                if deadline <= now:
                    del self._deadlines[key]
                    self._failures.setdefault(
                        key,
                        RequestFailure(
                            key,
                            TransferStage.WATCHDOG,
                            f"no completion or failure reported within the deadline for {key}",
                        ),
                    )
            failures, self._failures = list(self._failures.values()), {}
        return failures

    @property
    def num_watched(self) -> int:
        with self._lock:
            return len(self._deadlines)
