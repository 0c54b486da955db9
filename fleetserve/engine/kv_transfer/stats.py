"""Counters and per-transfer observations of a KV connector, shipped to the API server's
`/metrics` with the scheduler's stats (`fleetserve:kv_transfer_*`, see `common.metric_names`).

Counters are cumulative; observations (one per finished transfer) are drained by whoever
exports them, and bounded in between, so a slow exporter never grows memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["KVTransferStats", "TransferObservation"]

_MAX_PENDING_OBSERVATIONS = 10_000


@dataclass
class TransferObservation:
    seconds: float
    bytes: int
    descriptors: int


@dataclass
class KVTransferStats:
    handshakes: int = 0
    """Handshakes this engine started (one per new producer)."""
    handshakes_served: int = 0
    transfers_ok: int = 0
    failures_by_stage: dict[str, int] = field(default_factory=dict)
    active_leases: int = 0
    lease_expirations: int = 0
    blocks_recomputed: int = 0
    tokens_loaded: int = 0
    """Prompt tokens a consumer took from producers instead of computing them."""
    control_messages_dropped: int = 0
    layer_pushes: int = 0
    """Push mode: layer writes issued while the prefill computed (before it finished)."""
    observations: list[TransferObservation] = field(default_factory=list)

    def count_failure(self, stage: str) -> None:
        self.failures_by_stage[stage] = self.failures_by_stage.get(stage, 0) + 1

    def observe(self, seconds: float, num_bytes: int, descriptors: int) -> None:
        self.transfers_ok += 1
        if len(self.observations) < _MAX_PENDING_OBSERVATIONS:
            self.observations.append(TransferObservation(seconds, num_bytes, descriptors))

    def take(self) -> KVTransferStats:
        """A copy for export; the observations move into it (the counters stay)."""
        observations, self.observations = self.observations, []
        return KVTransferStats(
            handshakes=self.handshakes,
            handshakes_served=self.handshakes_served,
            transfers_ok=self.transfers_ok,
            failures_by_stage=dict(self.failures_by_stage),
            active_leases=self.active_leases,
            lease_expirations=self.lease_expirations,
            blocks_recomputed=self.blocks_recomputed,
            tokens_loaded=self.tokens_loaded,
            control_messages_dropped=self.control_messages_dropped,
            layer_pushes=self.layer_pushes,
            observations=observations,
        )
