"""Producer leases on a finished prompt's KV blocks, and the consumer's heartbeat schedule.

The protocol is the one vLLM's NIXL connector settled on (anchors-pd-2026.md §1.3): the producer
holds a request's blocks for `lease_s` after the prompt finished; the consumer heartbeats from
the moment it first sees the request (so a decode engine queued for capacity keeps the lease),
every `lease_s / 6`, and each heartbeat extends the lease to `max(old, now + 2/3 lease_s)`, so a
stale or reordered heartbeat never shortens it. The reaper scans every entry (heartbeats update
entries in place, so expiry order is not insertion order) and frees every expired lease in one
pass. Times are `time.monotonic()` seconds of the process that keeps the table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["HeartbeatSchedule", "LeaseTable"]


@dataclass
class LeaseTable:
    """The producer's leases, keyed by transfer id; bounded by the blocks they hold."""

    lease_s: float

    def __post_init__(self) -> None:
        if self.lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {self.lease_s}")
        self._expiry: dict[str, float] = {}

    @property
    def extension_s(self) -> float:
        """How far a heartbeat pushes a lease beyond its arrival (2/3 of the lease)."""
        return self.lease_s * 2.0 / 3.0

    def __len__(self) -> int:
        return len(self._expiry)

    def __contains__(self, key: str) -> bool:
        return key in self._expiry

    def grant(self, key: str, now: float) -> float:
        """Start (or restart) a lease; returns its expiry."""
        self._expiry[key] = now + self.lease_s
        return self._expiry[key]

    def heartbeat(self, keys: Iterable[str], now: float) -> list[str]:
        """Extend the named leases to max(current, now + extension); unknown keys are ignored.

        Returns:
            The keys that had a lease (and now have at least `now + extension` left).
        """
        known = []
        for key in keys:
            expiry = self._expiry.get(key)
            if expiry is None:
                continue
            self._expiry[key] = max(expiry, now + self.extension_s)
            known.append(key)
        return known

    def release(self, key: str) -> bool:
        """The consumer is done (or the request ended): drop the lease; False if unknown."""
        return self._expiry.pop(key, None) is not None

    def expiry(self, key: str) -> float | None:
        return self._expiry.get(key)

    def reap(self, now: float) -> list[str]:
        """Remove and return every lease expired at `now` (a full scan, in key order)."""
        expired = sorted(key for key, expiry in self._expiry.items() if expiry <= now)
        for key in expired:
            del self._expiry[key]
        return expired


@dataclass
class HeartbeatSchedule:
    """The consumer's side: which producer leases to renew, and when.

    A key is added when the consumer first sees its request and removed when the transfer is
    done or has failed; `due(now)` returns, per producer, the keys whose heartbeat is due.
    """

    interval_s: float
    _next: dict[str, float] = field(default_factory=dict)
    _peer: dict[str, str] = field(default_factory=dict)

    @classmethod
    def for_lease(cls, lease_s: float) -> HeartbeatSchedule:
        """Heartbeats every lease/6: three in a row may be lost before a lease extended by
        2/3 of its length can lapse."""
        return cls(interval_s=lease_s / 6.0)

    def add(self, key: str, peer: str, now: float) -> None:
        """Start renewing `key` at `peer`; the first heartbeat is due at once."""
        self._next[key] = now
        self._peer[key] = peer

    def remove(self, key: str) -> None:
        self._next.pop(key, None)
        self._peer.pop(key, None)

    def __len__(self) -> int:
        return len(self._next)

    def due(self, now: float) -> dict[str, list[str]]:
        """Peer → keys to heartbeat now (each then next due `interval_s` later)."""
        batches: dict[str, list[str]] = {}
        for key, when in self._next.items():
            if when <= now:
                batches.setdefault(self._peer[key], []).append(key)
                self._next[key] = now + self.interval_s
        return batches
