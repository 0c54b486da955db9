"""Continuous-batching scheduler: one token budget per step, no prefill or decode phase.

Each step (`schedule`):

1. RUNNING requests, oldest first: each gets `num_tokens - num_computed_tokens` new tokens (a
   decode is 1, plus its pending drafts under speculative decoding; a prefill chunk more), capped
   by the long-prefill threshold, the remaining budget and max_model_len (drafts are cut first). When `allocate_slots` finds no room, a victim is preempted (FCFS: the newest
   running request; PRIORITY: the least important) and the allocation retried; if the victim is
   the current request, the running pass stops.
2. WAITING requests (new or preempted), only if nobody was preempted this step: prefix-cache hit,
   then `allocate_slots` with the watermark, up to `max_num_seqs` running requests.
3. The `SchedulerOutput`: new requests in full, running ones as deltas; then every scheduled
   request's `num_computed_tokens` advances by its scheduled tokens.

`update_from_output` rolls back the drafts the target rejected (`num_computed_tokens` loses
them; see `spec_decode.scheduling`), appends the sampled tokens, applies the stop conditions,
frees finished requests and keeps the runner's new drafts for the next step. A preempted request loses its blocks and its computed tokens and is resumed by recompute
(softened by the prefix cache).

With `max_concurrent_batches > 1` (pipeline parallelism) several scheduled batches may be in
flight at once: a request is in at most one of them and is skipped until its batch's output
returns (`batch_queue.InFlightRequests`), a batch takes an even share of the schedulable
requests over the free batch slots (so each stage gets one), and an output applies only to the
requests it carried.

With `async_scheduling` a step is scheduled while the previous one runs: running decodes are
scheduled again on output placeholders, and a token sampled for a request preempted meanwhile
is still appended to it (`async_scheduling` explains both).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from fleetserve.engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from fleetserve.engine.core.async_scheduling import AsyncRequestState
from fleetserve.engine.core.batch_queue import InFlightRequests
from fleetserve.engine.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from fleetserve.engine.core.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
    concat_logprobs_rows,
)
from fleetserve.engine.core.remote_kv import RemoteKV
from fleetserve.engine.core.request_queue import SchedulingPolicy, create_request_queue
from fleetserve.engine.core.scheduler_invariants import check_scheduler_invariants
from fleetserve.engine.core.step_deltas import StepDeltas
from fleetserve.engine.core.step_isolation import StepIsolation
from fleetserve.engine.core.stop_conditions import check_stop
from fleetserve.engine.eplb.stats import EplbStats
from fleetserve.engine.kv_transfer.base import KVConnectorScheduler, NoKVConnector
from fleetserve.engine.lora.scheduling import lora_fits
from fleetserve.engine.request import Request, RequestStatus
from fleetserve.engine.spec_decode.scheduling import SpecScheduling
from fleetserve.engine.structured_output.manager import StructuredOutputManager
from fleetserve.engine.structured_output.scheduling import StructuredOutputScheduling


class Scheduler:
    """Decides, each step, which requests compute how many tokens, and owns their KV blocks.

    Every live request is in `requests` (the source of truth) and in exactly one of `waiting`
    (WAITING or PREEMPTED; owns blocks only once its remote KV arrived), `running` (RUNNING,
    owns blocks) and `remote_kv.parked` (WAITING_FOR_REMOTE_KVS, owns blocks a connector is
    loading into).

    Args:
        scheduler_config: budgets, policy and admission options.
        cache_config: block size, prefix caching and the free-block watermark.
        num_kv_blocks: KV blocks available (including the null block 0).
        connector: the scheduler role of the KV connector (`NoKVConnector` when colocated).
        load_failure_policy: 'fail' or 'recompute', for remote loads that fail (`remote_kv`).
        structured_output: the engine's grammar manager (None: constrained requests refused).
        speculative_config: speculative decoding (drafts verified after a decode's real token,
            see `spec_decode.scheduling`); None = off.
        max_concurrent_batches: batches the engine keeps in flight at once (its executor's);
            above 1, requests in flight are tracked and skipped (see module doc).
        max_loras: LoRA adapters the running requests may use at once (None: LoRA off); a
            waiting request whose adapter would be one more waits (`lora.scheduling`).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        connector: KVConnectorScheduler | None = None,
        load_failure_policy: str = "fail",
        structured_output: StructuredOutputManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
        max_concurrent_batches: int = 1,
        max_loras: int | None = None,
        send_sampled_tokens: bool = False,
    ) -> None:
        """`send_sampled_tokens`: some runner samples nothing itself (a pipeline of several
        stages), so running requests' new tokens go with every step (see `step_deltas`)."""
        self.config = scheduler_config
        self.max_loras = max_loras
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
        self.connector.bind_block_table(self.kv_cache_manager.get_block_ids)
        self.remote_kv = RemoteKV(
            self.kv_cache_manager, self.connector, cache_config.block_size, load_failure_policy
        )
        """Requests waiting for remote KV and blocks held for transfers (see `remote_kv`)."""
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        """Finished or aborted since the last `schedule()`; sent to the runner to drop."""
        self.num_preemptions = 0
        self.eplb_stats: EplbStats | None = None
        """EPLB's latest counts from the workers (engines with EPLB)."""
        self.isolation = StepIsolation()
        """Suspects of a failed step, each run alone next (see `step_isolation`)."""
        self._pending_preempted: set[str] = set()
        """Preempted outside `schedule()` (a failed step's requests): told to the runner next."""
        self.deltas = StepDeltas(send_tokens=send_sampled_tokens)
        """What the runner has been sent of each request (new ones in full, then deltas)."""
        self.structured_output = StructuredOutputScheduling(structured_output)
        """Requests waiting for their grammar (WAITING_FOR_GRAMMAR), step bitmasks."""
        self._grammar_failures: list[EngineCoreOutput] = []
        """Requests whose grammar failed to compile, reported by the next update."""
        self.spec = SpecScheduling(speculative_config) if speculative_config else None
        """Pending drafts and acceptance counters (speculative decoding only)."""
        self.num_lookahead_tokens = self.spec.num_lookahead_tokens if self.spec else 0
        if self.spec is not None:
            self.spec.draft_filter = self.structured_output.valid_drafts
        self.in_flight = (
            InFlightRequests(max_concurrent_batches) if max_concurrent_batches > 1 else None
        )
        """Requests of the batches scheduled but not yet updated (None: one batch at a time)."""
        self.async_state = AsyncRequestState(self) if scheduler_config.async_scheduling else None
        """Placeholders and the steps in flight under async scheduling (None: off)."""

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
        if self.structured_output.add(request):
            # NOTE: it joins the waiting queue once its grammar compiled (`schedule`).
            self.connector.on_new_request(request)
            self.requests[request.request_id] = request
            return
        self.connector.on_new_request(request)
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
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.remote_kv.parked[request_id]
            elif request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                self.structured_output.remove(request_id)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_work(self) -> bool:
        """Live requests, or transfers the workers must keep polling (held blocks)."""
        return bool(self.requests) or self.remote_kv.pending

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # -- schedule ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts under the token budget (see module doc).

        After a failed step its suspects run first, each alone in a step of its own. Under
        async scheduling the step is recorded as in flight until its output is applied.
        """
        output = self._schedule()
        if self.async_state is not None:
            self.async_state.after_schedule(output)
        return output

    def needs_output_first(self) -> bool:
        """Async scheduling: whether the next schedule needs the output of the step in flight
        (a constrained request in it needs its accepted tokens for its grammar bitmask; step
        isolation runs suspects alone and must see each one's result)."""
        if self.isolation.active:
            return True
        return any(
            r.num_output_placeholders and r.structured_output is not None for r in self.running
        )

    def _schedule(self) -> SchedulerOutput:
        self.kv_cache_manager.begin_step()
        self._admit_compiled_grammars()
        if self.isolation.active:
            solo = self.isolation.next_solo(self.requests)
            if solo is not None:
                return self._schedule_alone(self.requests[solo])
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        new_block_ids: dict[str, list[int]] = {}
        spec_tokens: dict[str, list[int]] = {}
        preempted: list[Request] = []
        threshold = self._long_prefill_threshold()
        max_reqs = self._max_batch_requests()

        req_index = 0
        while req_index < len(self.running) and budget > 0 and len(num_scheduled) < max_reqs:
            request = self.running[req_index]
            if self._is_in_flight(request) or (
                self.async_state is not None and self.async_state.at_limit(request)
            ):
                req_index += 1
                continue
            drafts = self._pending_drafts(request)
            num_new = self._cap_new_tokens(
                request,
                request.num_tokens
                + request.num_output_placeholders
                + len(drafts)
                - request.num_computed_tokens,
                threshold,
                budget,
            )
            if num_new <= 0:
                req_index += 1
                continue
            new_blocks: KVCacheBlocks | None = None
            while new_blocks is None:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request,
                    num_new,
                    num_lookahead_tokens=self._lookahead(request.num_computed_tokens + num_new),
                )
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
                    spec_tokens.pop(victim.request_id, None)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            scheduled_running.append(request)
            new_block_ids[request.request_id] = new_blocks.get_block_ids()
            num_scheduled[request.request_id] = num_new
            if drafts:
                scheduled_drafts = SpecScheduling.cut(request, drafts, num_new)
                if scheduled_drafts:
                    spec_tokens[request.request_id] = scheduled_drafts
            budget -= num_new
            req_index += 1

        if not preempted:
            budget = self._admit_waiting(budget, threshold, num_scheduled, scheduled_new, max_reqs)

        output = self._build_output(
            scheduled_new, scheduled_running, new_block_ids, num_scheduled, preempted, spec_tokens
        )
        if self.spec is not None:
            for request in scheduled_running:
                # NOTE: drafts are verified once; the step's output brings the next ones.
                self.spec.forget(request.request_id)
        for request_id, num_tokens in num_scheduled.items():
            self.requests[request_id].num_computed_tokens += num_tokens
        if self.in_flight is not None and num_scheduled:
            self.in_flight.add(output, scheduled_new + scheduled_running)
        return output

    def _max_batch_requests(self) -> int:
        """Requests this batch may carry: all of them, or under pipelining its even share of
        the schedulable ones (`InFlightRequests.share`), so every stage gets a batch."""
        if self.in_flight is None:
            return self.config.max_num_seqs
        num_running = sum(1 for request in self.running if request not in self.in_flight)
        num_admissible = min(len(self.waiting), self.config.max_num_seqs - len(self.running))
        return self.in_flight.share(num_running + max(num_admissible, 0))

    def _is_in_flight(self, request: Request) -> bool:
        """Whether `request` is in a batch whose output has not been applied yet (its next
        tokens depend on that output, and its state is about to change)."""
        return self.in_flight is not None and request in self.in_flight

    def _schedule_alone(self, request: Request) -> SchedulerOutput:
        """A step that runs only `request` (a suspect, waiting since its step failed), making
        room by preempting running requests from the tail."""
        preempted: list[Request] = []
        while self.running and not lora_fits(request, self.running, self.max_loras):
            # NOTE: the running requests must keep within max_loras adapters after it joins.
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
        num_new = self._admit(request, self.config.max_num_batched_tokens, threshold=0)
        while num_new is None and self.running:
            victim = self.running[-1]
            del self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            num_new = self._admit(request, self.config.max_num_batched_tokens, threshold=0)
        assert num_new is not None, f"suspect {request.request_id} does not fit even alone"
        output = self._build_output([request], [], {}, {request.request_id: num_new}, preempted)
        request.num_computed_tokens += num_new
        return output

    def recover_from_failed_step(
        self, scheduler_output: SchedulerOutput, error: BaseException
    ) -> list[EngineCoreOutput]:
        """Undo a step whose execution raised, and isolate the request that caused it.

        The step's requests are rolled back to before it and preempted (recomputed later). If
        the step ran one suspect alone, that request is the culprit: it is finished with the
        error; otherwise every request of the step becomes a suspect (see `step_isolation`).

        Returns:
            An output with `error` set for a request failed here (empty otherwise).

        Raises:
            RuntimeError: solo steps keep failing whoever runs: the engine itself is broken.
        """
        message = f"{type(error).__name__}: {error}"
        # NOTE: blocks this step indexed may hold garbage; so may blocks another request of the
        # step hit in the same step (sound only when the step completes): unindex them all.
        self.kv_cache_manager.discard_step()
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            # NOTE: before any free: `free` unindexes blocks past num_computed_tokens, and the
            # failed step's tokens were never written.
            self.requests[request_id].num_computed_tokens -= num_tokens
        outputs: list[EngineCoreOutput] = []
        if self.isolation.solo is not None:
            culprit = self.requests[self.isolation.solo_failed()]
            self.finish_requests(culprit.request_id, RequestStatus.FINISHED_ABORTED)
            outputs.append(
                EngineCoreOutput(
                    req_id=culprit.request_id,
                    new_token_ids=[],
                    finish_reason=RequestStatus.FINISHED_ABORTED.finish_reason,
                    num_cached_tokens=culprit.num_cached_tokens or 0,
                    error=message,
                )
            )
            return outputs
        self.isolation.suspect(scheduler_output.num_scheduled_tokens)
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[request_id]
            self.running.remove(request)
            self._preempt(request)
            self._pending_preempted.add(request_id)
        return outputs

    def recover_from_failed_async_step(
        self,
        failed: SchedulerOutput,
        later: list[SchedulerOutput],
        error: BaseException,
    ) -> list[EngineCoreOutput]:
        """Async scheduling: undo step `failed`, which raised, and the steps submitted after it
        (`later`, oldest first: they ran on state it should have produced; their results are
        dropped). The later steps' requests are preempted (recomputed later); the failed step's
        are isolated as by `recover_from_failed_step`.

        Only the requests still running as the objects each step carried are rolled back: one
        finished or preempted meanwhile has nothing of these steps left to undo.
        """
        state = self.async_state
        assert state is not None, "recover_from_failed_async_step without async scheduling"
        victims: list[Request] = []
        for output in reversed(later):
            for req_id, num_tokens in self._running_of(state.live(output)).items():
                request = self.requests[req_id]
                request.num_computed_tokens -= num_tokens
                if request not in victims:
                    victims.append(request)
            state.discard(output)
        live = self._running_of(state.live(failed))
        state.discard(failed)
        outputs = self.recover_from_failed_step(
            dataclasses.replace(failed, num_scheduled_tokens=live), error
        )
        for request in victims:
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self._preempt(request)
                self._pending_preempted.add(request.request_id)
        return outputs

    def _running_of(self, num_scheduled: dict[str, int]) -> dict[str, int]:
        return {
            req_id: num
            for req_id, num in num_scheduled.items()
            if self.requests[req_id].status == RequestStatus.RUNNING
        }

    def _admit_compiled_grammars(self) -> None:
        """Requests whose grammar compiled join the waiting queue; failed ones finish."""
        if not self.structured_output:
            return
        ready, failed = self.structured_output.take_compiled()
        for request in ready:
            request.status = RequestStatus.WAITING
            self.waiting.add(request)
        for request, error in failed:
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)
            self._grammar_failures.append(
                EngineCoreOutput(request.request_id, [], finish_reason="abort", error=error)
            )

    def _admit_waiting(
        self,
        budget: int,
        threshold: int,
        num_scheduled: dict[str, int],
        scheduled_new: list[Request],
        max_reqs: int,
    ) -> int:
        """Move WAITING/PREEMPTED requests into RUNNING while they fit (the step carrying at
        most `max_reqs` requests); returns the budget left."""
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(num_scheduled) < max_reqs
        ):
            request = self.waiting.peek()
            if self._is_in_flight(request):
                break  # NOTE: preempted while in flight: re-admitted once its batch is back
            if not lora_fits(request, self.running, self.max_loras):
                break  # NOTE: FCFS: it waits at the head until a running adapter is done
            num_new = self._admit(request, budget, threshold)
            if num_new is None:
                break
            if num_new == 0:
                continue  # parked until its remote KV arrives
            scheduled_new.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        return budget

    def _admit(self, request: Request, budget: int, threshold: int) -> int | None:
        """Allocate a waiting request's blocks and move it to RUNNING; returns the tokens it
        computes this step, 0 when it was parked for an asynchronous remote load instead, or
        None (nothing changed) when it does not fit."""
        computed_blocks, num_hit, num_external, load_async = KVCacheBlocks(), 0, 0, False
        owns_blocks = bool(self.kv_cache_manager.get_block_ids(request.request_id))
        if not owns_blocks:
            computed_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit)
        if load_async:
            return self._park(request, computed_blocks, num_hit, num_external)
        num_computed = request.num_computed_tokens + num_hit + num_external
        num_new = request.num_tokens - num_computed
        if not self.config.enable_chunked_prefill and num_new > budget:
            return None
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
            num_lookahead_tokens=self._lookahead(num_computed + num_new),
        )
        if new_blocks is None:
            return None
        self.connector.update_state_after_alloc(
            request, self.kv_cache_manager.get_block_ids(request.request_id), num_external
        )
        if not owns_blocks:
            # NOTE: counted once per admission, not per attempt: a request that waits for
            # room is looked up again every step, which must not inflate the hit metrics.
            self.kv_cache_manager.record_prefix_cache_lookup(request, num_hit)
        if self.waiting.peek() is request:
            self.waiting.pop()
        else:
            self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_computed
        return num_new

    def _park(
        self, request: Request, computed_blocks: KVCacheBlocks, num_hit: int, num_external: int
    ) -> int | None:
        """Park the request while a connector loads its remote prompt KV (0), or None when its
        blocks do not fit."""
        watermark = self.watermark_blocks if self.running else 0
        if not self.remote_kv.park(
            request,
            computed_blocks,
            num_hit,
            num_external,
            watermark_blocks=watermark,
            full_sequence_must_fit=self.config.full_sequence_must_fit,
        ):
            return None
        self.waiting.remove(request)
        return 0

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

    def _pending_drafts(self, request: Request) -> list[int]:
        """The drafts `request` verifies if scheduled now (never past the KV cache's size)."""
        if self.spec is None:
            return []
        drafts = self.spec.pending_drafts(request)
        return drafts[: max(self.max_seq_len - request.num_tokens, 0)]

    def _lookahead(self, num_tokens: int) -> int:
        """KV slots to reserve past `num_tokens` (a draft model's KV), within the cache's size:
        a sole request must stay admissible."""
        return min(self.num_lookahead_tokens, max(self.max_seq_len - num_tokens, 0))

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
        if self.spec is not None:
            self.spec.forget(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # NOTE: its tokens in flight (async scheduling) arrive as stale tokens, appended while
        # it waits; none is a placeholder any more.
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.deltas.forget(request.request_id)
        self.waiting.prepend(request)

    def _build_output(
        self,
        scheduled_new: list[Request],
        scheduled_running: list[Request],
        new_block_ids: dict[str, list[int]],
        num_scheduled: dict[str, int],
        preempted: list[Request],
        spec_tokens: dict[str, list[int]] | None = None,
    ) -> SchedulerOutput:
        finished, self.finished_req_ids = self.finished_req_ids, set()
        # NOTE: a failed step's requests were preempted outside schedule(); the runner learns it
        # now (a request already re-admitted this step is rebuilt from its new data anyway).
        pending, self._pending_preempted = self._pending_preempted, set()
        output = self.deltas.build(
            scheduled_new,
            scheduled_running,
            new_block_ids,
            num_scheduled,
            finished_req_ids=finished,
            preempted_req_ids={request.request_id for request in preempted} | pending,
            block_ids_of=self.kv_cache_manager.get_block_ids,
            new_block_ids_to_zero=self.kv_cache_manager.take_new_block_ids(),
        )
        output.kv_connector_metadata = self.connector.build_connector_meta(output)
        output.scheduled_spec_decode_tokens = spec_tokens or {}
        # NOTE: a constrained request with drafts gets 1 + k mask rows (row j: after drafts
        # 0..j-1); its drafts were already cut to the grammar's valid prefix (`draft_filter`).
        output.grammar_bitmask = self.structured_output.bitmask(
            scheduled_new + scheduled_running, num_scheduled, spec_tokens
        )
        return output

    # -- update ------------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests.

        Returns:
            One `EngineCoreOutput` per request that received tokens this step.
        """
        outputs, self._grammar_failures = self._grammar_failures, []
        carried = None if self.in_flight is None else self.in_flight.complete(scheduler_output)
        scheduled = (
            None if self.async_state is None else self.async_state.complete(scheduler_output)
        )
        for req_id, sampled in zip(
            model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True
        ):
            request = self.requests.get(req_id)
            if carried is not None and request not in carried:
                # NOTE: finished since the batch was scheduled, maybe resubmitted under the same
                # id (another object): the output is not this request's.
                continue
            stale = False
            if scheduled is not None:
                if request is None or scheduled.get(req_id) is not request:
                    continue  # NOTE: as above: finished (or resubmitted) since it was scheduled
                if sampled and self.async_state is not None:
                    self.async_state.resolve(request)
                # NOTE: preempted while this step ran: its token is still its own (stale).
                stale = request.status == RequestStatus.PREEMPTED
            prompt_rows = model_runner_output.prompt_logprobs.get(req_id)
            if prompt_rows is not None and request is not None:
                request.prompt_logprobs_rows = concat_logprobs_rows(
                    request.prompt_logprobs_rows, prompt_rows
                )
            if (
                not sampled
                or request is None
                or (request.status != RequestStatus.RUNNING and not stale)
            ):
                # NOTE: finished (aborted) or preempted since the step was scheduled: stale.
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts and self.spec is not None:
                # NOTE: before the stop checks and any free: the rejected drafts' KV is not the
                # request's, and `free` unindexes blocks past num_computed_tokens.
                request.num_computed_tokens -= self.spec.num_rejected(len(drafts), len(sampled))
            assert stale or request.num_computed_tokens >= request.num_tokens, (
                f"tokens sampled for {req_id} before its prompt was computed"
            )
            new_token_ids: list[int] = []
            for token_id in sampled:
                request.append_output_token_ids([token_id])
                new_token_ids.append(token_id)
                if check_stop(request, self.max_seq_len):
                    break
            grammar_error = self.structured_output.accept(request, new_token_ids)
            if grammar_error is not None:
                request.status = RequestStatus.FINISHED_ABORTED
            logprobs = model_runner_output.logprobs.get(req_id)
            if logprobs is not None and len(logprobs.sampled_token_ranks) > len(new_token_ids):
                logprobs = logprobs.head(len(new_token_ids))
            outputs.append(
                EngineCoreOutput(
                    req_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=logprobs,
                    prompt_logprobs=request.prompt_logprobs_rows,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens or 0,
                    error=grammar_error,
                )
            )
            request.prompt_logprobs_rows = None
            if request.is_finished:
                if stale:
                    self.waiting.remove(request)
                else:
                    self.running.remove(request)
                outputs[-1].kv_transfer_params = self._free_request(request)
            elif self.spec is not None:
                self.spec.set_drafts(req_id, model_runner_output.spec_token_ids.get(req_id, []))
        outputs += self._apply_connector_output(model_runner_output)
        if model_runner_output.eplb_stats is not None:
            self.eplb_stats = model_runner_output.eplb_stats
        if not scheduler_output.is_empty:
            # NOTE: only a step that computed something shows the engine works.
            self.isolation.step_succeeded()
        return outputs

    def _free_request(self, request: Request) -> dict[str, Any] | None:
        """Forget a finished request; returns the connector's `kv_transfer_params` for it.

        Its blocks are freed now, or held while a transfer may still use them (the connector
        says which; the workers report when they are released, see `remote_kv`).
        """
        assert request.is_finished, f"freeing unfinished request {request.request_id}"
        self.isolation.forget(request.request_id)
        if self.spec is not None:
            self.spec.forget(request.request_id)
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        delay_free, kv_transfer_params = self.connector.request_finished(request, block_ids)
        if delay_free:
            self.remote_kv.hold(request)
        else:
            self.kv_cache_manager.free(request)
        self.deltas.forget(request.request_id)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        return kv_transfer_params

    def _apply_connector_output(
        self, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Resume or fail parked requests whose loads finished, free released blocks; returns
        the outputs of requests that failed here."""
        kv_output = model_runner_output.kv_connector_output
        if kv_output is None or kv_output.is_empty:
            return []
        failed: list[EngineCoreOutput] = []
        for outcome in self.remote_kv.apply(kv_output):
            request = outcome.request
            if outcome.error is None:
                self.waiting.prepend(request)
                continue
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)
            failed.append(EngineCoreOutput(request.request_id, [], finish_reason="abort",
                                           error=outcome.error))  # fmt: skip
        return failed

    # -- introspection -----------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting)
            + len(self.remote_kv.parked)
            + len(self.structured_output),
            num_waiting_prompt_tokens=sum(
                max(0, r.num_prompt_tokens - r.num_computed_tokens)
                for r in (*self.waiting, *self.running)
            ),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=self.kv_cache_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache_manager.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_decoding=self.spec.stats.copy() if self.spec is not None else None,
            eplb=self.eplb_stats,
        )

    def check_invariants(self) -> None:
        """Assert the container and KV invariants (cheap enough for every test step)."""
        check_scheduler_invariants(self)
