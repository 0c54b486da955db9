"""The scheduler with several batches in flight (pipeline parallelism's batch queue), against a
deterministic fake model: a request in flight is never scheduled again before its output is
back, and the tokens of every request equal those of the synchronous loop, with chunked
prefill, preemption of requests in flight, and abort + resubmit of a request in flight."""

from __future__ import annotations

from collections import deque

import pytest

from fleetserve.engine.config import CacheConfig, SchedulerConfig
from fleetserve.engine.core.batch_queue import BatchQueue
from fleetserve.engine.core.outputs import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from fleetserve.engine.core.scheduler import Scheduler
from fleetserve.engine.request import RequestStatus
from fleetserve.engine.worker.executor import StepFuture
from tests.factories import make_request

BLOCK_SIZE = 4


def _scheduler(max_concurrent_batches: int, num_blocks: int = 14) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=12,
            max_model_len=64,
            enable_chunked_prefill=True,
            long_prefill_token_threshold=6,
        ),
        CacheConfig(
            block_size=BLOCK_SIZE,
            num_kv_blocks=num_blocks,
            enable_prefix_caching=True,
            watermark=0.0,
        ),
        num_blocks,
        max_concurrent_batches=max_concurrent_batches,
        send_sampled_tokens=True,  # NOTE: a pipeline's first stages sample nothing themselves
    )


def _fake_model(scheduler: Scheduler, output: SchedulerOutput) -> ModelRunnerOutput:
    """What the runner returns for `output`, computed when it is scheduled (as the workers do):
    a request whose known tokens are all computed samples a token that depends on all of them
    (so a wrong token count or a lost token changes every later token)."""
    req_ids = list(output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        assert request.num_computed_tokens <= request.num_tokens
        done = request.num_computed_tokens == request.num_tokens
        tokens = request.all_token_ids
        sampled.append([(sum(t * (i + 1) for i, t in enumerate(tokens)) % 97) + 3] if done else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


class _Run:
    """Drives a scheduler as the engine core's batch queue does, with the fake model."""

    def __init__(self, scheduler: Scheduler, depth: int) -> None:
        self.scheduler = scheduler
        self.depth = depth
        self.queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.tokens: dict[str, list[int]] = {}
        self.max_depth = 0
        self.preempted_in_flight = 0
        self.batch_sizes: list[int] = []

    def step(self) -> None:
        scheduler = self.scheduler
        if len(self.queue) < self.depth:
            output = scheduler.schedule()
            scheduler.check_invariants()
            in_flight = {r for so, _ in self.queue for r in so.num_scheduled_tokens}
            self.preempted_in_flight += len(output.preempted_req_ids & in_flight)
            assert not set(output.num_scheduled_tokens) & in_flight, "scheduled twice in flight"
            if not output.is_empty:
                self.batch_sizes.append(len(output.num_scheduled_tokens))
                self.queue.append((output, _fake_model(scheduler, output)))
                self.max_depth = max(self.max_depth, len(self.queue))
                return
            self._apply(output, ModelRunnerOutput.empty())
            if not self.queue:
                return
        self._apply(*self.queue.popleft())

    def _apply(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        for result in self.scheduler.update_from_output(output, runner_output):
            self.tokens.setdefault(result.req_id, []).extend(result.new_token_ids)
        self.scheduler.check_invariants()

    def until_done(self) -> dict[str, list[int]]:
        for _ in range(2000):
            if not self.scheduler.has_unfinished_requests() and not self.queue:
                return self.tokens
            self.step()
        raise AssertionError("requests did not finish")


def _prompts() -> dict[str, list[int]]:
    lengths = [3, 11, 6, 17, 2, 9, 14]
    return {f"r{i}": [(7 * i + 3 * j) % 50 + 1 for j in range(n)] for i, n in enumerate(lengths)}


@pytest.mark.parametrize("depth", [2, 3])
def test_batches_in_flight_give_the_synchronous_tokens(depth: int) -> None:
    results = {}
    for d in (1, depth):
        scheduler = _scheduler(d)
        for req_id, prompt in _prompts().items():
            scheduler.add_request(make_request(req_id, prompt, 8, block_size=BLOCK_SIZE))
        run = _Run(scheduler, d)
        results[d] = run.until_done()
        if d > 1:
            assert run.max_depth == d, "the queue never filled"
            assert run.preempted_in_flight > 0, "no request was preempted while in flight"
        assert scheduler.num_preemptions > 0
        assert scheduler.kv_cache_manager.num_free_blocks == 13
    assert results[depth] == results[1]
    assert all(len(tokens) == 8 for tokens in results[1].values())


@pytest.mark.parametrize("depth", [2, 3])
def test_a_steady_decode_is_split_over_the_stages(depth: int) -> None:
    """Six requests decoding over `depth` stages run as `depth` batches of 6 / depth: not one
    batch of six that leaves the other stages idle."""
    results = {}
    for d in (1, depth):
        scheduler = _scheduler(d, num_blocks=40)
        for i in range(6):
            scheduler.add_request(make_request(f"r{i}", [i + 1, 2], 12, block_size=BLOCK_SIZE))
        run = _Run(scheduler, d)
        results[d] = run.until_done()
        if d > 1:
            assert run.batch_sizes == [6 // d] * (len(run.batch_sizes)), run.batch_sizes
            assert len(run.batch_sizes) == 12 * d
    assert results[depth] == results[1]


def test_a_request_in_flight_waits_for_its_output() -> None:
    scheduler = _scheduler(2)
    scheduler.add_request(make_request("a", [1, 2, 3], 4, block_size=BLOCK_SIZE))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 3}
    # Its next token depends on the first batch's output: nothing to schedule meanwhile.
    assert scheduler.schedule().is_empty
    scheduler.add_request(make_request("b", [4, 5], 4, block_size=BLOCK_SIZE))
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"b": 2}
    assert scheduler.update_from_output(first, _fake_model_after(first, {"a": 9}))[0].req_id == "a"
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"a": 1}  # b is still in flight
    assert third.scheduled_cached_reqs.new_token_ids == [[9]]


def _fake_model_after(output: SchedulerOutput, tokens: dict[str, int]) -> ModelRunnerOutput:
    req_ids = list(output.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[tokens[r]] for r in req_ids])


def test_abort_and_resubmit_while_in_flight_drops_the_old_output() -> None:
    scheduler = _scheduler(2)
    scheduler.add_request(make_request("a", [1, 2, 3], 4, block_size=BLOCK_SIZE))
    first = scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    resubmitted = make_request("a", [8, 8], 4, block_size=BLOCK_SIZE)
    scheduler.add_request(resubmitted)
    second = scheduler.schedule()
    assert second.finished_req_ids == {"a"} and second.num_scheduled_tokens == {"a": 2}
    # The first batch's token was the aborted request's: the new one must not receive it.
    assert scheduler.update_from_output(first, _fake_model_after(first, {"a": 5})) == []
    assert resubmitted.output_token_ids == []
    (result,) = scheduler.update_from_output(second, _fake_model_after(second, {"a": 6}))
    assert (result.req_id, result.new_token_ids) == ("a", [6])
    scheduler.check_invariants()


def test_batch_queue_is_bounded_and_oldest_first() -> None:
    queue = BatchQueue(2)
    outputs = [SchedulerOutput([], CachedRequestData(), {}, 0, set()) for _ in range(3)]
    for output in outputs[:2]:
        queue.push(output, StepFuture.completed(ModelRunnerOutput.empty()))
    assert queue.full and len(queue) == 2 and queue.max_depth == 2
    with pytest.raises(RuntimeError, match="batch queue full"):
        queue.push(outputs[2], StepFuture.completed(ModelRunnerOutput.empty()))
    assert queue.pop_oldest().scheduler_output is outputs[0]
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        BatchQueue(0)


def test_a_request_preempted_in_flight_is_readmitted_only_after_its_batch() -> None:
    scheduler = _scheduler(3, num_blocks=4)  # 3 usable blocks of 4 tokens
    scheduler.add_request(make_request("a", [1, 2, 3, 4], 4, block_size=BLOCK_SIZE))
    first = scheduler.schedule()  # a: 1 block
    scheduler.add_request(make_request("b", [5, 6, 7, 8, 9, 10], 4, block_size=BLOCK_SIZE))
    second = scheduler.schedule()  # b: 2 blocks, the cache is full
    assert second.num_scheduled_tokens == {"b": 6}
    scheduler.update_from_output(first, _fake_model_after(first, {"a": 11}))
    third = scheduler.schedule()  # a's token needs a block: b, in flight, is preempted
    assert third.preempted_req_ids == {"b"} and third.num_scheduled_tokens == {"a": 1}
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # room for b again
    # b's batch is still in flight (its stages may still write its KV): not readmitted yet.
    assert scheduler.schedule().num_scheduled_tokens == {}
    assert scheduler.update_from_output(second, _fake_model_after(second, {"b": 12})) == []
    scheduler.update_from_output(third, _fake_model_after(third, {"a": 13}))
    readmitted = scheduler.schedule()
    # Recomputed, after a prefix hit on the full block its preempted batch wrote.
    assert readmitted.num_scheduled_tokens == {"b": 2}
    assert [(n.req_id, n.num_computed_tokens) for n in readmitted.scheduled_new_reqs] == [("b", 4)]
    scheduler.check_invariants()
