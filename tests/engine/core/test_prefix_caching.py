"""Prefix caching through the scheduler: hit lengths, the recomputed last token, salts, stats."""

from __future__ import annotations

from fleetserve.engine.core.outputs import ModelRunnerOutput
from fleetserve.engine.core.scheduler import Scheduler
from fleetserve.engine.request import Request
from tests.factories import make_request, make_scheduler, runner_output, step

PROMPT = list(range(100, 133))  # 33 tokens: 2 full blocks + 1


def run_to_completion(scheduler: Scheduler, request: Request) -> None:
    scheduler.add_request(request)
    for _ in range(100):
        if request.request_id not in scheduler.requests:
            return
        step(scheduler)
    raise AssertionError("request did not finish")


def test_full_hit_computes_exactly_one_token() -> None:
    scheduler = make_scheduler()
    run_to_completion(scheduler, make_request("a", PROMPT, max_tokens=1))
    scheduler.add_request(make_request("b", PROMPT, max_tokens=1))
    output = scheduler.schedule()
    (new,) = output.scheduled_new_reqs
    assert new.num_computed_tokens == 32
    assert output.num_scheduled_tokens == {"b": 1}
    assert new.block_ids[:2] == [1, 2]  # a's cached blocks, shared
    (result,) = scheduler.update_from_output(output, runner_output(scheduler, output))
    assert result.num_cached_tokens == 32 and result.finish_reason == "length"


def test_block_aligned_prompt_recomputes_its_last_block() -> None:
    scheduler = make_scheduler()
    run_to_completion(scheduler, make_request("a", PROMPT[:32], max_tokens=1))
    scheduler.add_request(make_request("b", PROMPT[:32], max_tokens=1))
    output = scheduler.schedule()
    # The hit may not cover the last token, and only whole blocks hit: 16 cached, 16 computed.
    assert output.scheduled_new_reqs[0].num_computed_tokens == 16
    assert output.num_scheduled_tokens == {"b": 16}


def test_hit_stops_at_the_first_missing_block() -> None:
    scheduler = make_scheduler()
    run_to_completion(scheduler, make_request("a", list(range(49)), max_tokens=1))
    other = list(range(49))
    other[20] = 999  # block 1 differs; block 2's tokens match but its chain does not
    scheduler.add_request(make_request("b", other, max_tokens=1))
    output = scheduler.schedule()
    assert output.scheduled_new_reqs[0].num_computed_tokens == 16


def test_cache_salt_isolates_tenants() -> None:
    scheduler = make_scheduler()
    run_to_completion(scheduler, make_request("a", PROMPT, max_tokens=1, cache_salt="t1"))
    scheduler.add_request(make_request("b", PROMPT, max_tokens=1, cache_salt="t2"))
    scheduler.add_request(make_request("c", PROMPT, max_tokens=1))
    scheduler.add_request(make_request("d", PROMPT, max_tokens=1, cache_salt="t1"))
    output = scheduler.schedule()
    computed = {n.req_id: n.num_computed_tokens for n in output.scheduled_new_reqs}
    assert computed == {"b": 0, "c": 0, "d": 32}


def test_generated_tokens_fill_blocks_that_later_requests_hit() -> None:
    scheduler = make_scheduler()
    a = make_request("a", list(range(30)), max_tokens=3)
    run_to_completion(scheduler, a)
    assert a.all_token_ids == [*list(range(30)), 7, 7, 7]
    # Tokens 30 and 31 (outputs) were computed, so block 1 is cached; token 32 never was.
    scheduler.add_request(make_request("b", [*a.all_token_ids[:32], 1, 2], max_tokens=1))
    output = scheduler.schedule()
    assert output.scheduled_new_reqs[0].num_computed_tokens == 32


def test_same_step_requests_share_blocks_allocated_in_that_step() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", PROMPT, max_tokens=1))
    scheduler.add_request(make_request("b", PROMPT, max_tokens=1))
    output = scheduler.schedule()
    blocks = {n.req_id: n.block_ids for n in output.scheduled_new_reqs}
    # NOTE: b reads blocks a writes in the same forward pass (each layer writes the whole
    # batch's KV before attention), exactly like vLLM.
    assert blocks == {"a": [1, 2, 3], "b": [1, 2, 4]}
    assert output.num_scheduled_tokens == {"a": 33, "b": 1}
    assert output.new_block_ids_to_zero == [1, 2, 3, 4]


def test_prefix_cache_stats_count_tokens() -> None:
    scheduler = make_scheduler()
    run_to_completion(scheduler, make_request("a", PROMPT, max_tokens=1))
    run_to_completion(scheduler, make_request("b", PROMPT, max_tokens=1))
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (66, 32)
    assert stats.kv_cache_usage == 0.0 and stats.num_running_reqs == 0


def test_prefix_caching_off_never_hits() -> None:
    scheduler = make_scheduler(enable_prefix_caching=False)
    run_to_completion(scheduler, make_request("a", PROMPT, max_tokens=1))
    scheduler.add_request(make_request("b", PROMPT, max_tokens=1))
    output = scheduler.schedule()
    assert output.scheduled_new_reqs[0].num_computed_tokens == 0
    assert output.scheduled_new_reqs[0].block_ids == [
        1,
        2,
        3,
    ]  # freed unhashed blocks are reused first
    scheduler.update_from_output(output, ModelRunnerOutput.empty())


def test_reset_prefix_cache_forgets_hits() -> None:
    scheduler = make_scheduler()
    run_to_completion(scheduler, make_request("a", PROMPT, max_tokens=1))
    assert scheduler.reset_prefix_cache() is True
    scheduler.add_request(make_request("b", PROMPT, max_tokens=1))
    assert scheduler.schedule().scheduled_new_reqs[0].num_computed_tokens == 0
    assert scheduler.reset_prefix_cache() is False  # b owns blocks


def test_a_request_waiting_for_room_is_counted_once() -> None:
    # 5 usable blocks: "a" holds 3 while it decodes, so "b" (3 blocks) waits several steps and
    # is looked up again each step; the metrics count its lookup once, when it is admitted.
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", list(range(40)), max_tokens=4))
    step(scheduler)
    scheduler.add_request(make_request("b", list(range(100, 140)), max_tokens=1))
    waited = 0
    while "b" not in {r.request_id for r in scheduler.running} and scheduler.requests:
        if "b" in scheduler.requests and scheduler.requests["b"] in scheduler.waiting:
            waited += 1
        step(scheduler)
    assert waited >= 2
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (40 + 40, 0)
