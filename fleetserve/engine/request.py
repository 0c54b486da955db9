"""The engine-side request and its state machine.

    WAITING ──schedule──► RUNNING ──(eos | stop token | max_tokens | max_model_len)──► FINISHED_*
     │  ▲                   │
     │  └─── PREEMPTED ◄────┘  (blocks freed, num_computed_tokens reset; resumes by recompute)
     ├──► WAITING_FOR_REMOTE_KVS ──(load done or failed)──► WAITING
     │    (blocks allocated and fenced while a KV connector loads them; other requests run)
     └──► WAITING_FOR_GRAMMAR ──(compiled)──► WAITING, or (compile failed) ──► FINISHED_ABORTED
  (a structured-output request enters here from add_request; it holds no blocks meanwhile)

Any live state can go to FINISHED_ABORTED. The scheduler owns the transitions; the request only
keeps the token lists and counters the scheduler needs (`num_computed_tokens` catching up with
`num_tokens`: there is no prefill or decode phase).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fleetserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from fleetserve.common.block_hash import BlockHash
    from fleetserve.engine.core.outputs import LogprobsLists
    from fleetserve.engine.lora.request import LoRARequest
    from fleetserve.engine.structured_output.request_grammar import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    """Blocks allocated; a KV connector is loading the prompt's KV from a remote engine."""
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    """Its structured-output grammar is compiling (see `fleetserve.engine.structured_output`)."""
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        # NOTE: an explicit set, not an ordering: a status added later cannot become "finished"
        # by where it is declared.
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI finish_reason for a finished status: 'stop', 'length' or 'abort'."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}

BlockHasher = Callable[["Request"], "list[BlockHash]"]
"""Returns the hashes of the request's newly completed full blocks (see kv_cache_utils)."""


class Request:
    """One sequence being generated (a `SamplingParams.n > 1` request becomes n of these)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        block_hasher: BlockHasher | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        """Tokens that end the request (unless `ignore_eos`); see `tokenizer.eos_token_ids`."""
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.kv_transfer_params = kv_transfer_params
        """The P/D protocol's parameters (`kv_transfer.params`), read by the KV connector."""
        self.lora_request = lora_request
        """The adapter it runs under (None: the base model); part of its blocks' hashes."""
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        """The stop token id or stop string that ended the request, if any."""

        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        """Tokens whose KV is in the cache (prefix hits and external loads count); under async
        scheduling also the positions of tokens still in flight (`num_output_placeholders`)."""
        self.num_output_placeholders = 0
        """Async scheduling: tokens being sampled by steps in flight, not yet appended (the
        scheduler counts them as known when it schedules the next decode)."""
        self.num_cached_tokens: int | None = None
        """Prefix-cache hit length at first scheduling (None until scheduled)."""
        self.num_preemptions = 0
        self.max_tokens = sampling_params.max_tokens
        self.prompt_logprobs_rows: LogprobsLists | None = None
        """Prompt logprobs gathered chunk by chunk until they go out with the first token."""

        self.structured_output: RequestGrammar | None = None
        """Its grammar (compiling, then ready) when `sampling_params.structured_outputs` is set;
        advanced by every output token, so it survives preemption and recompute."""

        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()

    # -- token bookkeeping -------------------------------------------------------------------

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs (read-only view by convention)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Extend `block_hashes` with every full block completed since the last call."""
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
