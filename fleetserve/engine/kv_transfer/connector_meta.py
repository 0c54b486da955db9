"""What the P2P connector's two roles tell each other each step (plain data: it may cross
processes, and with several ranks each rank's report is aggregated).

Scheduler → workers (`P2PMetadata`, in `SchedulerOutput.kv_connector_metadata`):
- `watches`: consumer requests first seen: start heartbeating their producer's lease at once (a
  decode engine queued for capacity keeps the lease) and handshake early;
- `loads`: consumer requests whose blocks were allocated this step: pull the producer's blocks
  into them (or, in push mode, ask the producer to write them);
- `holds`: producer requests finished this step: keep serving their blocks under a lease;
- `saves`: producer requests computed this step (push mode): write what is ready;
- `cancels`: transfers whose request ended: stop heartbeats, stop or refuse the transfer.

Workers → scheduler (`KVConnectorOutput`, in `ModelRunnerOutput.kv_connector_output`):
- `finished_sending`: producer requests whose held blocks may be freed (consumer done, lease
  expired, or cancelled);
- `finished_recving`: consumer requests whose load ended, successfully or not (a failed load
  is also finished, so nothing waits forever); `failed_recving` says which failed and why, and
  `invalid_block_ids` which of their blocks hold no valid KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetserve.engine.kv_transfer.base import KVConnectorMetadata
from fleetserve.engine.kv_transfer.params import ConsumerParams

__all__ = [
    "HoldSpec",
    "KVConnectorOutput",
    "LoadSpec",
    "OutputAggregator",
    "P2PMetadata",
    "SaveSpec",
    "WatchSpec",
]


@dataclass(frozen=True, slots=True)
class WatchSpec:
    request_id: str
    params: ConsumerParams


@dataclass(frozen=True, slots=True)
class LoadSpec:
    request_id: str
    params: ConsumerParams
    local_block_ids: tuple[int, ...]
    """Where the loaded blocks go, in prompt order."""
    first_block: int
    """Index, in the prompt's blocks, of the first block loaded (blocks before it hit locally);
    the producer's blocks to read are `params.remote_block_ids[first_block:]` (pull)."""
    deadline_s: float
    """Monotonic time by which the load must have finished or failed (the watchdog's)."""
    error: str | None = None
    """Set when the load cannot even start (the params do not cover the blocks): the workers
    report it failed at once."""


@dataclass(frozen=True, slots=True)
class HoldSpec:
    request_id: str
    key: str
    """The transfer id consumers name (`remote_request_id`)."""
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class SaveSpec:
    request_id: str
    key: str
    block_ids: tuple[int, ...]
    """The request's blocks holding KV computed so far (push mode writes what is new)."""
    num_computed_tokens: int


@dataclass
class P2PMetadata(KVConnectorMetadata):
    watches: list[WatchSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    holds: list[HoldSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    """Request ids."""


@dataclass
class KVConnectorOutput:
    """One step's completions from the workers (merged over ranks with `aggregate`)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: dict[str, str] = field(default_factory=dict)
    """Request id → "stage: message" for loads that failed."""
    invalid_block_ids: set[int] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not (
            self.finished_sending
            or self.finished_recving
            or self.failed_recving
            or self.invalid_block_ids
        )


class OutputAggregator:
    """Merges the ranks' reports over the steps: a request counts as finished (sending or
    receiving) only once every rank has reported it, since each rank moves its own share of
    the KV; a failure or an invalid block reported by any rank counts at once."""

    def __init__(self, num_ranks: int) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self.num_ranks = num_ranks
        self._sending: dict[str, int] = {}
        self._recving: dict[str, int] = {}

    def aggregate(self, outputs: list[KVConnectorOutput]) -> KVConnectorOutput:
        """One step's reports, one per rank, → what is finished on every rank by now."""
        merged = KVConnectorOutput()
        for output in outputs:
            merged.failed_recving.update(output.failed_recving)
            merged.invalid_block_ids |= output.invalid_block_ids
            for request_id in output.finished_sending:
                self._sending[request_id] = self._sending.get(request_id, 0) + 1
            for request_id in output.finished_recving:
                self._recving[request_id] = self._recving.get(request_id, 0) + 1
        for counts, done in ((self._sending, merged.finished_sending),
                             (self._recving, merged.finished_recving)):  # fmt: skip
            for request_id, count in list(counts.items()):
                if count >= self.num_ranks:
                    done.add(request_id)
                    del counts[request_id]
        return merged
