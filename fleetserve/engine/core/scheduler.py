"""Continuous-batching scheduler: one token budget per step, no prefill or decode phase.

Each step (`schedule`):

1. RUNNING requests, oldest first: each gets `num_tokens - num_computed_tokens` new tokens (a
   decode is 1, a prefill chunk more), capped by the long-prefill threshold, the remaining budget
   and max_model_len. When `allocate_slots` finds no room, a victim is preempted (FCFS: the newest
   running request; PRIORITY: the least important) and the allocation retried; if the victim is
   the current request, the running pass stops.
2. WAITING requests (new or preempted), only if nobody was preempted this step: prefix-cache hit,
   then `allocate_slots` with the watermark, up to `max_num_seqs` running requests.
3. The `SchedulerOutput`: new requests in full, running ones as deltas; then every scheduled
   request's `num_computed_tokens` advances by its scheduled tokens.

`update_from_output` appends the sampled tokens, applies the stop conditions and frees finished
requests. A preempted request loses its blocks and its computed tokens and is resumed by recompute
(softened by the prefix cache).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from fleetserve.engine.config import CacheConfig, SchedulerConfig
from fleetserve.engine.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from fleetserve.engine.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
    concat_logprobs_rows,
)
from fleetserve.engine.core.request_queue import SchedulingPolicy, create_request_queue
from fleetserve.engine.kv_transfer.base import KVConnectorScheduler, NoKVConnector
from fleetserve.engine.request import Request, RequestStatus


class Scheduler:
    """Decides, each step, which requests compute how many tokens, and owns their KV blocks.

    Every live request is in `requests` (the source of truth) and in exactly one of `waiting`
    (WAITING or PREEMPTED) and `running` (RUNNING, owns blocks).

    Args:
        scheduler_config: budgets, policy and admission options.
        cache_config: block size, prefix caching and the free-block watermark.
        num_kv_blocks: KV blocks available (including the null block 0).
        connector: the scheduler role of the KV connector (`NoKVConnector` when colocated).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.config = scheduler_config
        self.connector = connector if connector is not None else NoKVConnector()
        self.block_size = cache_config.block_size
        self.policy = SchedulingPolicy(scheduler_config.policy)
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_kv_blocks,
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            max_model_len=scheduler_config.max_model_len,
        )
        self.watermark_blocks = math.ceil(cache_config.watermark * num_kv_blocks)
        # NOTE: a sequence may not outgrow the whole KV cache: alone, it would preempt itself and
        # never be readmitted (a hung engine). Capping it finishes it as 'length' instead.
        self.max_seq_len = min(
            scheduler_config.max_model_len, (num_kv_blocks - 1) * cache_config.block_size
        )
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        """Finished or aborted since the last `schedule()`; sent to the runner to drop."""
        self.num_preemptions = 0
        self._num_tokens_sent: dict[str, int] = {}
        """Per running request: how many of its tokens the runner has been sent."""

    # -- request lifecycle -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request in WAITING.

        Raises:
            ValueError: if a live request already has this id, or if the request can never be
                admitted: its prompt (with `full_sequence_must_fit`, prompt + max_tokens) needs
                more blocks than the whole cache holds. Queued, it would block the queue forever.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        num_tokens = request.num_tokens
        if self.config.full_sequence_must_fit:
            max_tokens = request.max_tokens or self.config.max_model_len
            num_tokens = min(num_tokens + max_tokens, self.config.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        num_usable = self.kv_cache_manager.block_pool.num_blocks - 1
        if num_blocks > num_usable:
            raise ValueError(
                f"request {request.request_id!r} needs {num_blocks} KV blocks of "
                f"{self.block_size} tokens but the cache holds {num_usable}; "
                "shorten the prompt or max_tokens"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish (e.g. abort) live requests by id; unknown or finished ids are ignored.

        Raises:
            ValueError: if `finished_status` is not a FINISHED_* status.
        """
        if not finished_status.is_finished:
            raise ValueError(
                f"finished_status must be a FINISHED_* status, got {finished_status!r}"
            )
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # -- schedule ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts under the token budget (see module doc)."""
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        new_block_ids: dict[str, list[int]] = {}
        preempted: list[Request] = []
        threshold = self._long_prefill_threshold()

        req_index = 0
        while req_index < len(self.running) and budget > 0:
            request = self.running[req_index]
            num_new = self._cap_new_tokens(
                request, request.num_tokens - request.num_computed_tokens, threshold, budget
            )
            if num_new <= 0:
                req_index += 1
                continue
            new_blocks: KVCacheBlocks | None = None
            while new_blocks is None:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                del self.running[victim_index]
                if victim_index < req_index:
                    req_index -= 1
                if victim.request_id in num_scheduled:
                    # NOTE: refund exactly what the victim took this step; its blocks are freed
                    # by the preemption below.
                    scheduled_running.remove(victim)
                    budget += num_scheduled.pop(victim.request_id)
                    new_block_ids.pop(victim.request_id)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            scheduled_running.append(request)
            new_block_ids[request.request_id] = new_blocks.get_block_ids()
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            req_index += 1

        if not preempted:
            budget = self._admit_waiting(budget, threshold, num_scheduled, scheduled_new)

        output = self._build_output(
            scheduled_new, scheduled_running, new_block_ids, num_scheduled, preempted
        )
        for request_id, num_tokens in num_scheduled.items():
            self.requests[request_id].num_computed_tokens += num_tokens
        return output

    def _admit_waiting(
        self,
        budget: int,
        threshold: int,
        num_scheduled: dict[str, int],
        scheduled_new: list[Request],
    ) -> int:
        """Move WAITING/PREEMPTED requests into RUNNING while they fit; returns the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            computed_blocks, num_hit, num_external = KVCacheBlocks(), 0, 0
            if request.num_computed_tokens == 0:
                computed_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
                num_external, load_async = self.connector.get_num_new_matched_tokens(
                    request, num_hit
                )
                # NOTE: the asynchronous load path (WAITING_FOR_REMOTE_KVS) comes with the first
                # real connector (issue 14); the no-op connector never asks for it.
                assert not load_async, "asynchronous KV loads are not supported yet"
            num_computed = request.num_computed_tokens + num_hit + num_external
            num_new = request.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = self._cap_new_tokens(request, num_new, threshold, budget, num_computed)
            assert num_new > 0, f"waiting request {request.request_id} has nothing to compute"
            # NOTE: the watermark only guards admissions next to other requests: a sole request
            # must always be admissible, or an engine with a tiny cache would never start one.
            watermark = self.watermark_blocks if self.running else 0
            new_blocks = self.kv_cache_manager.allocate_slots(
                request,
                num_new,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=computed_blocks,
                num_external_computed_tokens=num_external,
                full_sequence_must_fit=self.config.full_sequence_must_fit,
                watermark_blocks=watermark,
            )
            if new_blocks is None:
                break
            self.connector.update_state_after_alloc(
                request, self.kv_cache_manager.get_block_ids(request.request_id), num_external
            )
            if request.num_computed_tokens == 0:
                # NOTE: counted once per admission, not per attempt: a request that waits for
                # room is looked up again every step, which must not inflate the hit metrics.
                self.kv_cache_manager.record_prefix_cache_lookup(request, num_hit)
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_computed
            scheduled_new.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        return budget

    def _cap_new_tokens(
        self,
        request: Request,
        num_new: int,
        threshold: int,
        budget: int,
        num_computed: int | None = None,
    ) -> int:
        computed = request.num_computed_tokens if num_computed is None else num_computed
        if 0 < threshold < num_new:
            num_new = threshold
        return min(num_new, budget, self.config.max_model_len - computed)

    def _long_prefill_threshold(self) -> int:
        """Per-request chunk cap for this step (0 = none).

        Off when configured off, without chunked prefill, or with a single eligible request (it
        may use the whole budget); otherwise raised to the fair share of the budget.
        """
        configured = self.config.long_prefill_token_threshold
        if configured == 0 or not self.config.enable_chunked_prefill:
            return 0
        num_eligible = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        if num_eligible <= 1:
            return 0
        return max(configured, self.config.max_num_batched_tokens // num_eligible)

    def _pick_victim(self) -> Request:
        if self.policy is SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Free `request`'s blocks and send it to the front of the waiting queue (recompute)."""
        # NOTE: free before resetting num_computed_tokens: `free` uses it to unindex blocks whose
        # KV was never written.
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._num_tokens_sent.pop(request.request_id, None)
        self.waiting.prepend(request)

    def _build_output(
        self,
        scheduled_new: list[Request],
        scheduled_running: list[Request],
        new_block_ids: dict[str, list[int]],
        num_scheduled: dict[str, int],
        preempted: list[Request],
    ) -> SchedulerOutput:
        new_reqs = []
        for request in scheduled_new:
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=list(request.prompt_token_ids),
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    num_computed_tokens=request.num_computed_tokens,
                    eos_token_ids=request.eos_token_ids,
                )
            )
            self._num_tokens_sent[request.request_id] = request.num_tokens
        cached = CachedRequestData()
        for request in scheduled_running:
            num_sent = self._num_tokens_sent.get(request.request_id, request.num_tokens)
            cached.req_ids.append(request.request_id)
            cached.new_token_ids.append(request.all_token_ids[num_sent:])
            cached.new_block_ids.append(new_block_ids[request.request_id])
            cached.num_computed_tokens.append(request.num_computed_tokens)
            self._num_tokens_sent[request.request_id] = request.num_tokens
        finished, self.finished_req_ids = self.finished_req_ids, set()
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
            preempted_req_ids={request.request_id for request in preempted},
            new_block_ids_to_zero=self.kv_cache_manager.take_new_block_ids(),
        )
        output.kv_connector_metadata = self.connector.build_connector_meta(output)
        return output

    # -- update ------------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests.

        Returns:
            One `EngineCoreOutput` per request that received tokens this step.
        """
        outputs: list[EngineCoreOutput] = []
        for req_id, sampled in zip(
            model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True
        ):
            request = self.requests.get(req_id)
            prompt_rows = model_runner_output.prompt_logprobs.get(req_id)
            if prompt_rows is not None and request is not None:
                request.prompt_logprobs_rows = concat_logprobs_rows(
                    request.prompt_logprobs_rows, prompt_rows
                )
            if not sampled or request is None or request.status != RequestStatus.RUNNING:
                # NOTE: finished (aborted) or preempted since the step was scheduled: stale.
                continue
            assert request.num_computed_tokens >= request.num_tokens, (
                f"tokens sampled for {req_id} before its prompt was computed"
            )
            new_token_ids: list[int] = []
            for token_id in sampled:
                request.append_output_token_ids([token_id])
                new_token_ids.append(token_id)
                if self._check_stop(request):
                    break
            logprobs = model_runner_output.logprobs.get(req_id)
            if logprobs is not None and len(logprobs.sampled_token_ranks) > len(new_token_ids):
                logprobs = _head_rows(logprobs, len(new_token_ids))
            outputs.append(
                EngineCoreOutput(
                    req_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=logprobs,
                    prompt_logprobs=request.prompt_logprobs_rows,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens or 0,
                )
            )
            request.prompt_logprobs_rows = None
            if request.is_finished:
                self.running.remove(request)
                self._free_request(request)
        return outputs

    def _check_stop(self, request: Request) -> bool:
        """Apply the stop conditions after one appended token; sets the FINISHED_* status."""
        params = request.sampling_params
        over_length = request.num_tokens >= self.max_seq_len or (
            request.max_tokens is not None and request.num_output_tokens >= request.max_tokens
        )
        if request.num_output_tokens >= params.min_tokens:
            last_token = request.output_token_ids[-1]
            if not params.ignore_eos and last_token in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if last_token in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last_token
                return True
        if over_length:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _free_request(self, request: Request) -> None:
        assert request.is_finished, f"freeing unfinished request {request.request_id}"
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        delay_free, _ = self.connector.request_finished(request, block_ids)
        # NOTE: deferred frees (a producer's blocks held for its consumer) come with the first
        # real connector (issue 14); the no-op connector never holds blocks.
        assert not delay_free, "connector-held blocks are not supported yet"
        self.kv_cache_manager.free(request)
        self._num_tokens_sent.pop(request.request_id, None)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    # -- introspection -----------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=self.kv_cache_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache_manager.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )

    def check_invariants(self) -> None:
        """Assert the container and KV invariants (cheap enough for every test step)."""
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        assert len(set(running_ids)) == len(running_ids), "a request is twice in running"
        assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
        assert sorted(running_ids + waiting_ids) == sorted(self.requests), (
            "running + waiting differ from the live requests"
        )
        assert len(self.running) <= self.config.max_num_seqs, "more running than max_num_seqs"
        for request in self.running:
            assert request.status == RequestStatus.RUNNING, f"{request} in running"
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), (
                f"{request} in waiting"
            )
            assert not self.kv_cache_manager.get_block_ids(request.request_id), (
                f"waiting {request} owns blocks"
            )
        self.kv_cache_manager.block_pool.check_integrity()


def _head_rows(logprobs: LogprobsLists, num_rows: int) -> LogprobsLists:
    """The first `num_rows` rows (tokens after a stop are dropped, so are their logprobs)."""
    return LogprobsLists(
        logprob_token_ids=logprobs.logprob_token_ids[:num_rows],
        logprobs=logprobs.logprobs[:num_rows],
        sampled_token_ranks=logprobs.sampled_token_ranks[:num_rows],
    )
