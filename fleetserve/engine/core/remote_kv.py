"""The scheduler's side of KV transfers: requests waiting for remote KV, blocks held for others.

A consumer request whose prompt KV comes from a producer is *parked* here with its blocks
allocated but not in the prefix cache (nobody may hit blocks still being written) until the
workers report its load finished. Then it either *resumes* (its loaded tokens count as computed
and its blocks are indexed) or, when the load failed, the load-failure policy applies:

- `fail` (the default, as in vLLM): the request ends at once with an error naming the stage;
  its blocks are freed, never indexed, so no other request reads them;
- `recompute`: exactly the blocks from the first invalid one on are recomputed locally (the valid
  prefix is kept and indexed), counted in `num_recomputed_blocks`.

A request that ends while its load is in flight keeps its blocks *held* until the workers report
the load stopped: a block is never reused while a transfer may still write into it. So does a
producer request whose blocks a consumer is still reading (until `finished_sending`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetserve.common.error_codes import KV_TRANSFER_FAILED
from fleetserve.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from fleetserve.engine.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from fleetserve.engine.kv_transfer.base import KVConnectorScheduler
    from fleetserve.engine.kv_transfer.connector_meta import KVConnectorOutput

__all__ = ["LoadOutcome", "RemoteKV"]


@dataclass
class _Parked:
    request: Request
    num_local: int
    """Tokens the request had computed (its local prefix hit) when parked."""
    num_external: int


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    request: Request
    error: str | None
    """None: resume the request (its computed tokens are set); else end it with this error."""


class RemoteKV:
    """Parked consumer requests and held blocks (see the module docstring)."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        connector: KVConnectorScheduler,
        block_size: int,
        load_failure_policy: str,
    ) -> None:
        self.kv = kv_cache_manager
        self.connector = connector
        self.block_size = block_size
        self.policy = load_failure_policy
        self.parked: dict[str, _Parked] = {}
        self.held: dict[str, Request] = {}
        """Finished requests whose blocks stay allocated until the workers release them."""
        self.num_recomputed_blocks = 0
        self.num_failed_loads = 0

    @property
    def pending(self) -> bool:
        """Work the workers must keep polling even when nothing is scheduled."""
        return bool(self.parked or self.held)

    def park(
        self,
        request: Request,
        computed_blocks: KVCacheBlocks,
        num_local: int,
        num_external: int,
        *,
        watermark_blocks: int,
        full_sequence_must_fit: bool,
    ) -> bool:
        """Allocate blocks for the whole prompt (kept out of the prefix cache) and park the
        request while the connector loads `num_external` tokens after its `num_local` hit;
        False (nothing changed) when the blocks do not fit."""
        new_blocks = self.kv.allocate_slots(
            request,
            1,  # the last prompt token, computed here for its logits
            num_new_computed_tokens=num_local,
            new_computed_blocks=computed_blocks,
            num_external_computed_tokens=num_external,
            full_sequence_must_fit=full_sequence_must_fit,
            watermark_blocks=watermark_blocks,
            delay_cache_blocks=True,
        )
        if new_blocks is None:
            return False
        self.kv.record_prefix_cache_lookup(request, num_local)
        request.num_computed_tokens = num_local
        self.connector.update_state_after_alloc(
            request, self.kv.get_block_ids(request.request_id), num_external
        )
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.parked[request.request_id] = _Parked(request, num_local, num_external)
        return True

    def hold(self, request: Request) -> None:
        """Keep a finished request's blocks until the workers report the transfer ended."""
        self.parked.pop(request.request_id, None)
        self.held[request.request_id] = request

    def apply(self, output: KVConnectorOutput) -> list[LoadOutcome]:
        """Fold the workers' completions in; returns what became of parked requests."""
        outcomes: list[LoadOutcome] = []
        for request_id in sorted(output.finished_recving):
            self.connector.load_finished(request_id)
            held = self.held.pop(request_id, None)
            if held is not None:  # ended while loading: now nothing writes into its blocks
                self.kv.free(held)
                continue
            parked = self.parked.pop(request_id, None)
            if parked is None:
                continue
            failure = output.failed_recving.get(request_id)
            outcomes.append(self._finish_load(parked, failure, output.invalid_block_ids))
        for request_id in sorted(output.finished_sending):
            held = self.held.pop(request_id, None)
            if held is not None:
                self.kv.free(held)
        return outcomes

    def _finish_load(
        self, parked: _Parked, failure: str | None, invalid_block_ids: set[int]
    ) -> LoadOutcome:
        request = parked.request
        request.status = RequestStatus.WAITING
        loaded = parked.num_external
        if failure is not None:
            self.num_failed_loads += 1
            if self.policy == "fail":
                return LoadOutcome(request, f"{KV_TRANSFER_FAILED}: {failure}")
            loaded = self._valid_loaded_tokens(parked, invalid_block_ids)
            num_loaded_blocks = -(-(parked.num_local + parked.num_external) // self.block_size)
            num_valid_blocks = (parked.num_local + loaded) // self.block_size
            self.num_recomputed_blocks += num_loaded_blocks - num_valid_blocks
        request.num_computed_tokens = parked.num_local + loaded
        self.kv.cache_blocks(request, request.num_computed_tokens)
        return LoadOutcome(request, None)

    def _valid_loaded_tokens(self, parked: _Parked, invalid_block_ids: set[int]) -> int:
        """Loaded tokens before the request's first invalid block (all of them are invalid when
        the load failed without naming blocks: nothing it wrote can be trusted)."""
        block_ids = self.kv.get_block_ids(parked.request.request_id)
        first = parked.num_local // self.block_size
        last = -(-(parked.num_local + parked.num_external) // self.block_size)
        named = [i for i in range(first, last) if block_ids[i] in invalid_block_ids]
        if not named:
            return 0
        return max(0, named[0] * self.block_size - parked.num_local)
