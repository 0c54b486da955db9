"""Property-based state machine over the real scheduler, KV cache manager and block pool.

Hypothesis drives random sequences of add / abort / step / prefix-cache reset / failing steps
(a poisoned request makes any step it is in fail part-way, as a sampler rejecting its settings
would; the scheduler must roll the step back and isolate the culprit) against a small
cache (so preemption and eviction happen all the time), with prompts drawn from a few shared
prefixes (so prefix hits happen too). A shadow copy of the KV cache records which token each
slot holds, written by a fake runner exactly where the scheduler's block tables say; after every
rule the container and pool invariants hold, and every prefix hit serves blocks whose shadow
content is the hitting request's own tokens (a stale or never-written block would differ), counting
the tokens its step writes (each layer writes the whole batch's K/V before any row attends).
"""

from __future__ import annotations

import dataclasses

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from fleetserve.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from fleetserve.engine.core.scheduler import Scheduler
from fleetserve.engine.core.step_isolation import MAX_CONSECUTIVE_SOLO_FAILURES
from fleetserve.engine.request import RequestStatus
from tests.factories import make_request, make_scheduler

BLOCK_SIZE = 4
PREFIXES = [[1] * 6, [2, 3] * 5, list(range(10, 22))]


class SchedulerMachine(RuleBasedStateMachine):
    scheduler: Scheduler

    @initialize(
        num_blocks=st.integers(6, 16),
        budget=st.integers(4, 64),
        threshold=st.sampled_from([0, 3]),
        policy=st.sampled_from(["fcfs", "priority"]),
        chunked=st.booleans(),
        must_fit=st.booleans(),
    )
    def setup(
        self,
        num_blocks: int,
        budget: int,
        threshold: int,
        policy: str,
        chunked: bool,
        must_fit: bool,
    ) -> None:
        max_model_len = 48
        self.scheduler = make_scheduler(
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=budget if chunked else max(budget, max_model_len),
            max_num_seqs=4,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=threshold,
            policy=policy,
            full_sequence_must_fit=must_fit,
        )
        self.shadow: dict[int, list[int | None]] = {}
        """block id -> the token each of its slots holds (None: never written)."""
        self.counter = 0
        self.refused = 0
        self.poisoned: set[str] = set()
        """Requests whose steps fail (as a sampler rejecting their settings would)."""

    # -- rules -----------------------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(30, 40), max_size=14),
        max_tokens=st.integers(1, 8),
        priority=st.integers(0, 2),
    )
    def add(self, prefix: list[int], tail: list[int], max_tokens: int, priority: int) -> None:
        self.counter += 1
        request = make_request(
            f"r{self.counter}",
            prefix + tail,
            max_tokens=max_tokens,
            block_size=BLOCK_SIZE,
            priority=priority,
        )
        try:
            self.scheduler.add_request(request)
        except ValueError:
            # Too big for the whole cache: refused up front, never queued.
            self.refused += 1
            assert request.request_id not in self.scheduler.requests

    @precondition(lambda self: bool(self.scheduler.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        assert request_id not in self.scheduler.requests

    # NOTE: each live poisoned request can fail one solo step; MAX_CONSECUTIVE_SOLO_FAILURES of
    # them with no successful step between mean a broken engine, which ends it (tested in
    # test_step_isolation), so the machine stays below that.
    @precondition(
        lambda self: (
            bool(self.scheduler.requests)
            and len(self.poisoned & set(self.scheduler.requests))
            + self.scheduler.isolation.consecutive_solo_failures
            + 1
            < MAX_CONSECUTIVE_SOLO_FAILURES
        )
    )
    @rule(data=st.data())
    def poison(self, data: st.DataObject) -> None:
        self.poisoned.add(data.draw(st.sampled_from(sorted(self.scheduler.requests))))

    @rule(token=st.sampled_from([30, 31, 7]))
    def step(self, token: int) -> None:
        output = self.scheduler.schedule()
        if self.poisoned & set(output.num_scheduled_tokens):
            # The step fails part-way: its slots hold garbage (-1), which no later hit may see.
            self._write_shadow(output, garbage=True)
            failed = self.scheduler.recover_from_failed_step(output, ValueError("poisoned"))
            for failure in failed:
                assert failure.req_id in self.poisoned and failure.error is not None
                assert failure.req_id not in self.scheduler.requests
            return
        # NOTE: writes first: a request may hit blocks that another request of the same step is
        # computing, which is sound because each layer writes the whole batch's K/V before any
        # row attends.
        self._write_shadow(output)
        self._check_hits(output)
        sampled = []
        for req_id in output.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([token] if done else [])
        runner = ModelRunnerOutput(req_ids=list(output.num_scheduled_tokens),
                                   sampled_token_ids=sampled)  # fmt: skip
        self.scheduler.update_from_output(output, runner)

    @precondition(lambda self: self.scheduler.config.enable_chunked_prefill)
    @rule(budget=st.integers(1, 64))
    def change_budget(self, budget: int) -> None:
        # A step budget that varies from step to step (as under a spec-decode or DP balancer)
        # makes same-step preemptions of already scheduled requests (refunds) reachable.
        self.scheduler.config = dataclasses.replace(
            self.scheduler.config, max_num_batched_tokens=budget
        )

    @rule()
    def reset_prefix_cache(self) -> None:
        if self.scheduler.reset_prefix_cache():
            assert not self.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def containers_and_pool_agree(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        self.scheduler.check_invariants()
        manager = self.scheduler.kv_cache_manager
        assert 0.0 <= manager.usage <= 1.0
        for request in self.scheduler.running:
            num_blocks = len(manager.get_block_ids(request.request_id))
            assert num_blocks * BLOCK_SIZE >= request.num_computed_tokens, request
        if not self.scheduler.requests:
            assert manager.usage == 0.0, "idle scheduler still owns blocks"

    @invariant()
    def only_poisoned_requests_fail(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        isolation = self.scheduler.isolation
        assert set(isolation.suspects) <= set(self.scheduler.requests)

    @invariant()
    def indexed_blocks_hold_written_kv(self) -> None:
        """A block in the prefix-cache index must hold KV for every slot: an index entry for a
        block that was allocated but never written (e.g. its request was preempted in the same
        step) would serve garbage to the next hit."""
        if not hasattr(self, "scheduler"):
            return
        pool = self.scheduler.kv_cache_manager.block_pool
        for _, block in pool.cached_block_hash_to_block.items():
            slots = self.shadow.get(block.block_id, [None] * BLOCK_SIZE)
            assert None not in slots and -1 not in slots, (
                f"block {block.block_id} is indexed but holds {slots}"
            )

    # -- helpers ---------------------------------------------------------------------------

    def _check_hits(self, output: SchedulerOutput) -> None:
        """A new request's computed tokens (its prefix hit) must be its own tokens in cache."""
        for new in output.scheduled_new_reqs:
            tokens = new.prompt_token_ids + new.output_token_ids
            for pos in range(new.num_computed_tokens):
                block = new.block_ids[pos // BLOCK_SIZE]
                held = self.shadow.get(block, [None] * BLOCK_SIZE)[pos % BLOCK_SIZE]
                assert held == tokens[pos], (
                    f"{new.req_id} hit block {block} slot {pos % BLOCK_SIZE}: holds {held}, "
                    f"expected {tokens[pos]}"
                )

    def _write_shadow(self, output: SchedulerOutput, *, garbage: bool = False) -> None:
        manager = self.scheduler.kv_cache_manager
        for block_id in output.new_block_ids_to_zero:
            self.shadow[block_id] = [None] * BLOCK_SIZE
        for req_id, num_new in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            block_ids = manager.get_block_ids(req_id)
            end = request.num_computed_tokens  # advanced by schedule()
            for pos in range(end - num_new, end):
                slots = self.shadow.setdefault(block_ids[pos // BLOCK_SIZE], [None] * BLOCK_SIZE)
                slots[pos % BLOCK_SIZE] = -1 if garbage else request.all_token_ids[pos]


TestSchedulerStateMachine = SchedulerMachine.TestCase
TestSchedulerStateMachine.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None, derandomize=True
)
