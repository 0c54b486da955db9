"""Keeping one request's failure inside a step from ending the engine for everyone.

A step's forward pass or sampling can raise because of one request (sampling settings the
sampler rejects, later a grammar or a KV load that fails). The step cannot say which, so the
scheduler treats every request of the failed step as a suspect: it rolls the step back (their
computed tokens and blocks, as if preempted) and then runs each suspect alone, one step each,
before anything else runs. A suspect whose solo step succeeds is cleared; one whose solo step
fails is the culprit and is failed with the error (its client gets an error response), and
everyone else carries on by recompute, with exactly the tokens they would have produced.

An engine that fails whatever it runs (`MAX_CONSECUTIVE_SOLO_FAILURES` solo steps failing with
no successful step in between, each with a different request) is broken, not unlucky: that
failure is raised, and the engine core ends loudly. So does an error that says the device itself is gone (`is_unrecoverable`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["MAX_CONSECUTIVE_SOLO_FAILURES", "StepIsolation", "is_unrecoverable"]

MAX_CONSECUTIVE_SOLO_FAILURES = 3

_DEVICE_LOST = (
    "CUDA error",
    "device-side assert",
    "illegal memory access",
    "NCCL error",
    "CUBLAS_STATUS",
    "unspecified launch failure",
)
"""Messages of errors after which the device (and every request on it) is gone."""


def is_unrecoverable(error: BaseException) -> bool:
    """True for errors no request-level recovery can survive (a lost or poisoned device)."""
    if not isinstance(error, Exception):
        return True  # KeyboardInterrupt, SystemExit: not ours to swallow
    text = str(error)
    return any(marker in text for marker in _DEVICE_LOST)


@dataclass
class StepIsolation:
    """Which requests are suspected of failing a step, and which one runs alone now.

    Pure bookkeeping; the scheduler does the rolling back, the solo steps and the failing.
    """

    suspects: list[str] = field(default_factory=list)
    """Suspects in the order their solo steps run."""
    solo: str | None = None
    """The suspect the last `schedule()` ran alone (its outcome is pending)."""
    consecutive_solo_failures: int = 0

    @property
    def active(self) -> bool:
        return bool(self.suspects)

    def suspect(self, request_ids: Iterable[str]) -> None:
        """A step with these requests failed (none of them ran alone)."""
        for request_id in request_ids:
            if request_id not in self.suspects:
                self.suspects.append(request_id)

    def forget(self, request_id: str) -> None:
        """The request finished (e.g. its client aborted it): no longer a suspect."""
        if request_id in self.suspects and request_id != self.solo:
            self.suspects.remove(request_id)

    def next_solo(self, live: Iterable[str]) -> str | None:
        """The next suspect to run alone (dropping suspects that finished meanwhile), or None."""
        alive = set(live)
        self.suspects = [r for r in self.suspects if r in alive]
        self.solo = self.suspects[0] if self.suspects else None
        return self.solo

    def step_succeeded(self) -> None:
        """A step ran: its solo request (if any) is cleared, and the engine evidently works."""
        if self.solo is not None:
            self.suspects.remove(self.solo)
            self.solo = None
        self.consecutive_solo_failures = 0

    def solo_failed(self) -> str:
        """The solo step failed: returns its request (the culprit), no longer a suspect.

        Raises:
            RuntimeError: too many solo steps failed in a row: the engine itself is broken.
        """
        assert self.solo is not None, "no request ran alone"
        culprit, self.solo = self.solo, None
        self.suspects.remove(culprit)
        self.consecutive_solo_failures += 1
        if self.consecutive_solo_failures >= MAX_CONSECUTIVE_SOLO_FAILURES:
            raise RuntimeError(
                f"{self.consecutive_solo_failures} requests in a row failed even when run alone; "
                "the engine is broken, not one request"
            )
        return culprit
