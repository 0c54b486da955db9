"""The step contract between the scheduler and the model runner.

`SchedulerOutput` goes scheduler → runner once per step; `ModelRunnerOutput` comes back. Both are
plain dataclasses of lists and dicts (no tensors) so that they can cross a process boundary.

New requests (and requests resumed after preemption) are sent in full once, as `NewRequestData`;
requests the runner already holds are sent as deltas in `CachedRequestData`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetserve.engine.eplb.stats import EplbStats
from fleetserve.engine.kv_transfer.base import KVConnectorMetadata
from fleetserve.engine.kv_transfer.connector_meta import KVConnectorOutput
from fleetserve.engine.kv_transfer.stats import KVTransferStats
from fleetserve.engine.lora.request import LoRARequest
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.spec_decode.stats import SpecDecodingStats
from fleetserve.engine.structured_output.step_bitmask import GrammarBitmask


@dataclass
class NewRequestData:
    """A request the runner does not hold yet (or must rebuild after a preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Outputs generated before a preemption (empty for a fresh request)."""
    sampling_params: SamplingParams
    block_ids: list[int]
    """The request's whole block table."""
    num_computed_tokens: int
    """Tokens already in the KV cache (prefix hit or external load) before this step."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end the request (min_tokens blocks them until it is reached)."""
    lora_request: LoRARequest | None = None
    """The adapter it runs under (None: the base model)."""


@dataclass
class CachedRequestData:
    """Per-step deltas for requests the runner already holds (parallel lists)."""

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    """Each request's tokens since it was last sent, for runners that do not sample them (the
    stages of a pipeline before the last); empty (no list per request) in a one-stage engine,
    whose runners keep the tokens they sample (see `step_deltas`)."""
    new_block_ids: list[list[int]] = field(default_factory=list)
    """Blocks appended to each request's block table this step (block tables are append-only)."""
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """What to compute in one step."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """req_id → tokens to compute this step (a prefill chunk or 1 decode token)."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    """Requests finished or aborted since the last step: the runner drops their state."""
    preempted_req_ids: set[str] = field(default_factory=set)
    """Requests preempted this step: the runner drops them from the batch (they return as new)."""
    new_block_ids_to_zero: list[int] = field(default_factory=list)
    """Freshly allocated blocks to zero before use (stale NaNs would poison attention)."""
    kv_connector_metadata: KVConnectorMetadata | None = None
    """The KV connector's instructions to the workers this step (see `kv_transfer.base`)."""
    grammar_bitmask: GrammarBitmask | None = None
    """Structured output: the masks of the constrained requests that sample this step."""
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """req_id → the draft tokens verified this step; they follow the request's real tokens and
    count in its `num_scheduled_tokens` (speculative decoding)."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class LogprobsLists:
    """Sampled-token logprobs, row per sampled token (parallel lists, row order = req order).

    `logprob_token_ids[i][0]` is the sampled token, followed by the top-k tokens;
    `logprobs[i]` are their log-probabilities; `sampled_token_ranks[i]` the sampled token's rank
    (1 = most likely) in the raw distribution.
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]

    def head(self, num_rows: int) -> LogprobsLists:
        """The first `num_rows` rows (tokens after a stop are dropped, so are their logprobs)."""
        return LogprobsLists(
            logprob_token_ids=self.logprob_token_ids[:num_rows],
            logprobs=self.logprobs[:num_rows],
            sampled_token_ranks=self.sampled_token_ranks[:num_rows],
        )


@dataclass
class ModelRunnerOutput:
    """Result of one step, in the order of `req_ids`."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    """Tokens sampled per request; empty for a prefill chunk that did not reach the end."""
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    """Only for requests that asked for logprobs and sampled a token this step."""
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    """For requests that asked for prompt logprobs: one row per prompt position computed this
    step that has a next prompt token (row first = that token, then the top-k)."""
    kv_connector_output: KVConnectorOutput | None = None
    """The KV connector's completions this step (loads and sends that finished or failed)."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: req_id → drafts proposed for the request's next step."""
    eplb_stats: EplbStats | None = None
    """EPLB's counts, on the steps that changed them (a rebalance, a commit); else None."""

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        return cls(req_ids=[], sampled_token_ids=[])


@dataclass
class EngineCoreOutput:
    """What the engine core reports for one request after a step (sent to the front end)."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    prompt_logprobs: LogprobsLists | None = None
    """Rows for prompt tokens 1 .. P-1 (each given the tokens before it); sent once, with the
    request's first token."""
    finish_reason: str | None = None
    """'stop', 'length' or 'abort' once finished, else None."""
    stop_reason: int | str | None = None
    """The stop token id (or, set by the front end, the stop string) that ended it."""
    num_cached_tokens: int = 0
    error: str | None = None
    """Set when the engine failed this request on its own (its step raised while the rest of the
    batch went on, see `EngineCore.step`); finish_reason is then 'abort'. The front end answers
    it with an error, never with a normal completion."""
    kv_transfer_params: dict[str, Any] | None = None
    """With a KV connector: what the connector returns about the finished request (a producer's
    lease on its blocks), passed back to the client in the response."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """Scheduler state after a step, for metrics and the periodic stats log."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    """Fraction of usable KV blocks (excluding the null block) held by requests, in [0, 1]."""
    prefix_cache_queries: int = 0
    """Cumulative tokens looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """Cumulative tokens found in the prefix cache."""
    num_preemptions: int = 0
    """Cumulative preemptions."""
    num_waiting_prompt_tokens: int = 0
    """Prompt tokens still to compute, of waiting and of partially prefilled running requests."""
    kv_transfer: KVTransferStats | None = None
    """The KV connector's counters and this step's transfer observations (P/D engines)."""
    spec_decoding: SpecDecodingStats | None = None
    """Cumulative draft acceptance counters (engines with speculative decoding)."""
    num_batches_in_flight: int = 0
    """Batches submitted and not yet applied after the step (pipeline parallelism; else 0)."""
    max_batches_in_flight: int = 0
    """The most batches ever in flight at once (pipeline parallelism; else 0)."""
    eplb: EplbStats | None = None
    """EPLB's latest counts (engines with EPLB, once a rebalance came due)."""


def concat_logprobs_rows(first: LogprobsLists | None, more: LogprobsLists) -> LogprobsLists:
    """The rows of `first` (if any) followed by those of `more` (a new object)."""
    if first is None:
        return more
    return LogprobsLists(
        logprob_token_ids=first.logprob_token_ids + more.logprob_token_ids,
        logprobs=first.logprobs + more.logprobs,
        sampled_token_ranks=first.sampled_token_ranks + more.sampled_token_ranks,
    )
