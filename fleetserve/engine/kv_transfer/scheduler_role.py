"""The P2P connector's scheduler role: which tokens come from a producer, which blocks to hold.

It never touches tensors (the worker role moves the bytes); it only reads requests'
`kv_transfer_params` and the scheduler's block tables, and tells the workers, once per step,
what to watch, load, hold, save and cancel (`connector_meta`).

Consumer (decode engine): a request with `do_remote_prefill` takes from the producer every
prompt token but the last one beyond its own local prefix hit (a remote hit only replaces a
shorter local one). The last prompt token is always computed locally: its forward pass gives the
logits of the first output token, exactly as in a colocated engine. The load is asynchronous:
the request waits in WAITING_FOR_REMOTE_KVS with its blocks allocated (and out of the prefix
cache) until the workers report it finished.

Producer (prefill engine): a request with `do_remote_decode` computes its prompt and one token;
when it finishes, its blocks are held (the scheduler must not free them) and its response
carries the consumer's `kv_transfer_params`: this engine's identity, the transfer id and the
blocks. The workers free them when the consumer is done or the lease expires.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleetserve.engine.config import KVTransferConfig
from fleetserve.engine.kv_transfer.base import KVConnectorMetadata, KVConnectorScheduler
from fleetserve.engine.kv_transfer.connector_meta import (
    HoldSpec,
    LoadSpec,
    P2PMetadata,
    SaveSpec,
    WatchSpec,
)
from fleetserve.engine.kv_transfer.params import (
    ConsumerParams,
    ProducerParams,
    parse_kv_transfer_params,
)

if TYPE_CHECKING:
    from fleetserve.engine.core.outputs import SchedulerOutput
    from fleetserve.engine.request import Request

__all__ = ["EngineIdentity", "P2PConnectorScheduler"]


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """How consumers reach this engine's connector (what a producer's response names)."""

    engine_id: str
    host: str
    port: int
    """The control channel's port."""
    compatibility_hash: str


class P2PConnectorScheduler(KVConnectorScheduler):
    """Scheduler role of the tcp and mooncake connectors (the transport is the workers')."""

    def __init__(
        self,
        config: KVTransferConfig,
        block_size: int,
        identity: EngineIdentity,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.identity = identity
        self.block_ids_of: Callable[[str], list[int]] = lambda request_id: []
        self.clock = clock
        self._consumers: dict[str, ConsumerParams] = {}
        """Consumer requests whose load has not finished yet."""
        self._producers: dict[str, ProducerParams] = {}
        self._loading: set[str] = set()
        """Consumer requests whose load the workers were told to start."""
        self._meta = P2PMetadata()

    def bind_block_table(self, block_ids_of: Callable[[str], list[int]]) -> None:
        self.block_ids_of = block_ids_of

    @property
    def is_producer(self) -> bool:
        return self.config.role in ("producer", "both")

    @property
    def is_consumer(self) -> bool:
        return self.config.role in ("consumer", "both")

    # -- request lifecycle --------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """Classify the request; a consumer's heartbeats start now (see the module docstring).

        Raises:
            ValueError: the params are malformed, or ask for a role this engine does not play.
        """
        params = parse_kv_transfer_params(request.kv_transfer_params)
        if isinstance(params, ConsumerParams):
            if not self.is_consumer:
                raise ValueError(
                    f"kv_transfer_params: do_remote_prefill needs a consumer engine, this one "
                    f"is a {self.config.role}"
                )
            mine = self.identity.compatibility_hash
            if params.compatibility_hash is not None and params.compatibility_hash != mine:
                raise ValueError(
                    f"kv_transfer_params.compatibility_hash {params.compatibility_hash} (producer "
                    f"{params.remote_engine_id}) does not match this engine's {mine}: their KV "
                    "blocks mean different things (model, dtype, block size, layout, connector "
                    "or transfer mode differ)"
                )
            needed = -(-(params.remote_num_tokens or 0) // self.block_size)
            if params.remote_block_ids is not None and len(params.remote_block_ids) < needed:
                raise ValueError(
                    f"kv_transfer_params.remote_block_ids names {len(params.remote_block_ids)} "
                    f"blocks for {params.remote_num_tokens} tokens; blocks of {self.block_size} "
                    f"tokens need {needed}"
                )
            self._consumers[request.request_id] = params
            self._meta.watches.append(WatchSpec(request.request_id, params))
        elif isinstance(params, ProducerParams):
            if not self.is_producer:
                raise ValueError(
                    f"kv_transfer_params: do_remote_decode needs a producer engine, this one "
                    f"is a {self.config.role}"
                )
            self._producers[request.request_id] = params

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = self._consumers.get(request.request_id)
        if params is None or request.request_id in self._loading:
            return 0, False
        remote = params.remote_num_tokens or request.num_prompt_tokens
        # NOTE: the last prompt token is computed here for its logits; a remote hit that is not
        # longer than the local one loads nothing.
        usable = min(remote, request.num_prompt_tokens - 1)
        num_external = usable - num_computed_tokens
        if num_external <= 0:
            self._consumers.pop(request.request_id)
            self._meta.cancels.append(request.request_id)
            return 0, False
        return num_external, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens == 0:
            return
        params = self._consumers[request.request_id]
        first_block = request.num_computed_tokens // self.block_size
        last_block = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
        remote_ids = params.remote_block_ids
        error = None
        if remote_ids is not None and len(remote_ids) < last_block:
            # NOTE: reported as a failed load (never raised here, inside the step): the policy
            # then fails or recomputes the request like any other load failure.
            error = (
                f"kv_transfer_params.remote_block_ids names {len(remote_ids)} blocks, but the "
                f"prompt's first {request.num_computed_tokens + num_external_tokens} tokens "
                f"need {last_block}"
            )
        self._loading.add(request.request_id)
        self._meta.loads.append(
            LoadSpec(
                request_id=request.request_id,
                params=params,
                local_block_ids=tuple(block_ids[first_block:last_block]),
                first_block=first_block,
                deadline_s=self.clock() + self.config.transfer_timeout_s,
                error=error,
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.config.transfer_mode == "push":
            self._add_saves(scheduler_output)
        meta, self._meta = self._meta, P2PMetadata()
        return meta

    def _add_saves(self, scheduler_output: SchedulerOutput) -> None:
        """Push mode: producer requests computed this step, so the workers write out what is
        new as soon as each layer has it."""
        computed_before = {new.req_id: new.num_computed_tokens
                           for new in scheduler_output.scheduled_new_reqs}  # fmt: skip
        cached = scheduler_output.scheduled_cached_reqs
        computed_before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            producer = self._producers.get(request_id)
            if producer is None:
                continue
            self._meta.saves.append(
                SaveSpec(
                    request_id=request_id,
                    key=producer.transfer_id or request_id,
                    block_ids=tuple(self.block_ids_of(request_id)),
                    num_computed_tokens=computed_before[request_id] + num_tokens,
                )
            )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        if request_id in self._consumers:
            self._consumers.pop(request_id)
            self._meta.cancels.append(request_id)
            if request_id in self._loading:
                # NOTE: a load may still be writing into these blocks; the workers free them
                # once it has stopped (finished_recving), never before.
                return True, None
            return False, None
        producer = self._producers.pop(request_id, None)
        if producer is None or not block_ids:
            return False, None
        if request.status.finish_reason == "abort":
            self._meta.cancels.append(request_id)
            return False, None
        key = producer.transfer_id or request_id
        self._meta.holds.append(
            HoldSpec(request_id, key, tuple(block_ids), request.num_prompt_tokens)
        )
        params = ConsumerParams(
            remote_engine_id=self.identity.engine_id,
            remote_host=self.identity.host,
            remote_port=self.identity.port,
            remote_request_id=key,
            remote_block_ids=tuple(block_ids),
            remote_num_tokens=request.num_prompt_tokens,
            compatibility_hash=self.identity.compatibility_hash,
        )
        return True, params.to_dict()

    def load_finished(self, request_id: str) -> None:
        """The workers reported the request's load finished (done or failed)."""
        self._loading.discard(request_id)
        self._consumers.pop(request_id, None)
