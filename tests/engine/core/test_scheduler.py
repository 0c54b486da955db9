"""Scheduler: token budget, chunked prefill, preemption, admission rules, stop conditions."""

from __future__ import annotations

import dataclasses

import pytest

from fleetserve.engine.core.outputs import EngineCoreOutput, LogprobsLists, ModelRunnerOutput
from fleetserve.engine.core.request_queue import FCFSRequestQueue, PriorityRequestQueue
from fleetserve.engine.core.scheduler import Scheduler
from fleetserve.engine.request import Request, RequestStatus
from tests.factories import make_request, make_scheduler, runner_output, step


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# -- budget, chunked prefill and the long-prefill threshold (scenarios 13, 14) --------------


def test_long_prompt_is_chunked_without_starving_decodes() -> None:
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=64)
    scheduler.add_request(make_request("d1", tokens(0, 10), max_tokens=20))
    scheduler.add_request(make_request("d2", tokens(100, 10), max_tokens=20))
    assert step(scheduler).num_scheduled_tokens == {"d1": 10, "d2": 10}
    scheduler.add_request(make_request("long", tokens(1000, 200), max_tokens=5))
    chunks = []
    for _ in range(4):
        output = step(scheduler)
        assert output.num_scheduled_tokens["d1"] == output.num_scheduled_tokens["d2"] == 1
        assert output.total_num_scheduled_tokens <= 64
        chunks.append(output.num_scheduled_tokens["long"])
    assert chunks == [62, 62, 62, 14]
    assert scheduler.requests["long"].num_output_tokens == 1


def test_threshold_caps_a_running_prefill_so_new_requests_get_budget() -> None:
    scheduler = make_scheduler(
        num_blocks=64, max_num_batched_tokens=64, long_prefill_token_threshold=8
    )
    scheduler.add_request(make_request("long", tokens(1000, 200)))
    assert step(scheduler).num_scheduled_tokens == {"long": 64}  # alone: the threshold is off
    scheduler.add_request(make_request("d1", tokens(0, 10)))
    scheduler.add_request(make_request("d2", tokens(100, 10)))
    # Three eligible requests: the threshold rises to the fair share 64 // 3 = 21.
    assert step(scheduler).num_scheduled_tokens == {"long": 21, "d1": 10, "d2": 10}
    assert step(scheduler).num_scheduled_tokens == {"long": 21, "d1": 1, "d2": 1}


def test_adaptive_threshold_gives_each_of_k_requests_its_fair_share() -> None:
    scheduler = make_scheduler(
        num_blocks=128, max_num_batched_tokens=64, long_prefill_token_threshold=8
    )
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", tokens(1000 * i, 200)))
    output = step(scheduler)
    assert output.num_scheduled_tokens == {"r0": 16, "r1": 16, "r2": 16, "r3": 16}

    three = make_scheduler(
        num_blocks=128, max_num_batched_tokens=64, long_prefill_token_threshold=8
    )
    for i in range(3):
        three.add_request(make_request(f"r{i}", tokens(1000 * i, 200)))
    assert step(three).num_scheduled_tokens == {"r0": 21, "r1": 21, "r2": 21}


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits() -> None:
    scheduler = make_scheduler(
        num_blocks=32, max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False
    )
    scheduler.add_request(make_request("a", tokens(0, 40)))
    scheduler.add_request(make_request("b", tokens(100, 30)))
    scheduler.add_request(make_request("c", tokens(200, 5)))
    assert step(scheduler).num_scheduled_tokens == {"a": 40}  # b needs 30 > 24: stop admitting
    assert step(scheduler).num_scheduled_tokens == {"a": 1, "b": 30, "c": 5}


def test_max_num_seqs_caps_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", tokens(100 * i, 4), max_tokens=2))
    assert set(step(scheduler).num_scheduled_tokens) == {"r0", "r1"}
    assert set(step(scheduler).num_scheduled_tokens) == {"r0", "r1"}  # both finish here
    assert step(scheduler).num_scheduled_tokens == {"r2": 4}


# -- preemption (scenarios 15, 16, 17) -------------------------------------------------------


def test_fcfs_preempts_the_newest_and_the_victim_resumes_by_recompute() -> None:
    scheduler = make_scheduler(num_blocks=7)  # 6 usable blocks
    ids = {"r1": 1, "r2": 2, "r3": 3}
    for i, req_id in enumerate(ids):
        scheduler.add_request(make_request(req_id, tokens(100 * i, 30), max_tokens=10))
    first = step(scheduler, ids)
    assert [n.block_ids for n in first.scheduled_new_reqs] == [[1, 2], [3, 4], [5, 6]]
    step(scheduler, ids)
    step(scheduler, ids)  # each request now has 33 tokens and needs a third block

    output = step(scheduler, ids)
    assert output.preempted_req_ids == {"r3"}
    assert output.num_scheduled_tokens == {"r1": 1, "r2": 1}
    assert output.scheduled_cached_reqs.new_block_ids == [[6], [5]]  # r3's blocks, tail first
    assert output.new_block_ids_to_zero == [6, 5]
    r3 = scheduler.requests["r3"]
    assert (r3.status, r3.num_computed_tokens, r3.num_preemptions) == (
        RequestStatus.PREEMPTED,
        0,
        1,
    )
    assert r3.output_token_ids == [3, 3, 3]

    while "r1" in scheduler.requests or "r2" in scheduler.requests:
        output = step(scheduler, ids)
        assert "r3" not in output.num_scheduled_tokens
    resumed = step(scheduler, ids)
    (new,) = resumed.scheduled_new_reqs
    assert (new.req_id, new.output_token_ids, new.num_computed_tokens) == ("r3", [3, 3, 3], 0)
    assert resumed.num_scheduled_tokens == {"r3": 33}
    while "r3" in scheduler.requests:
        step(scheduler, ids)
    assert r3.output_token_ids == [3] * 10
    assert r3.all_token_ids == tokens(200, 30) + [3] * 10
    assert scheduler.make_stats().num_preemptions == 1


def test_preempted_request_reuses_its_own_cached_prefix() -> None:
    scheduler = make_scheduler(num_blocks=5)  # 4 usable blocks
    scheduler.add_request(make_request("a", tokens(0, 31), max_tokens=10))
    scheduler.add_request(make_request("b", tokens(100, 31), max_tokens=10))
    step(scheduler)
    step(scheduler)
    output = step(scheduler)  # a needs a 3rd block: b (newest) is preempted
    assert output.preempted_req_ids == {"b"}
    step(scheduler)  # b: 16-token hit (its block 3) + 2 new blocks > 1 free: still waiting
    while "a" in scheduler.requests:
        step(scheduler)
    output = step(scheduler)
    (new,) = output.scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens, new.block_ids[0]) == ("b", 16, 3)
    assert output.num_scheduled_tokens == {"b": 17}


def test_priority_preemption_refunds_a_victim_scheduled_this_step() -> None:
    scheduler = make_scheduler(num_blocks=6, policy="priority")  # 5 usable blocks
    lo = make_request("lo", tokens(0, 20), priority=1, arrival_time=0.0)
    scheduler.add_request(lo)
    step(scheduler)
    scheduler.add_request(make_request("hi", tokens(100, 31), priority=0, arrival_time=1.0))
    scheduler.add_request(make_request("x", tokens(200, 5), priority=0, arrival_time=2.0))
    assert step(scheduler).num_scheduled_tokens == {"lo": 1, "hi": 31, "x": 5}
    step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    # Two tokens of budget: lo (first in running) takes one, then hi needs a third block.
    scheduler.config = dataclasses.replace(scheduler.config, max_num_batched_tokens=2)
    output = scheduler.schedule()
    scheduler.check_invariants()
    assert output.preempted_req_ids == {"lo"}
    # lo's token is refunded, so x still gets scheduled after hi.
    assert output.num_scheduled_tokens == {"hi": 1, "x": 1}
    assert output.total_num_scheduled_tokens == 2
    assert output.scheduled_cached_reqs.req_ids == ["hi", "x"]
    assert output.scheduled_cached_reqs.new_block_ids == [[2], []]
    assert output.new_block_ids_to_zero == [2]
    assert (lo.status, lo.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    assert scheduler.kv_cache_manager.get_block_ids("lo") == []
    assert scheduler.kv_cache_manager.get_block_ids("hi") == [3, 4, 2]


def test_priority_preempts_the_current_request_when_it_is_the_least_important() -> None:
    scheduler = make_scheduler(num_blocks=5, policy="priority")
    scheduler.add_request(make_request("lo", tokens(0, 31), priority=5, arrival_time=0.0))
    scheduler.add_request(make_request("hi", tokens(100, 31), priority=0, arrival_time=1.0))
    assert step(scheduler).num_scheduled_tokens == {"hi": 31, "lo": 31}
    step(scheduler)
    output = step(scheduler)  # hi gets lo's freed block; lo stops itself
    assert output.preempted_req_ids == {"lo"}
    assert output.num_scheduled_tokens == {"hi": 1}


def test_a_step_with_preemption_admits_nobody() -> None:
    scheduler = make_scheduler(num_blocks=5)
    scheduler.add_request(make_request("r1", tokens(0, 31)))
    scheduler.add_request(make_request("r2", tokens(100, 31)))
    step(scheduler)
    step(scheduler)
    scheduler.add_request(make_request("w", tokens(200, 3)))
    output = step(scheduler)
    assert output.preempted_req_ids == {"r2"}
    assert output.num_scheduled_tokens == {"r1": 1}
    assert scheduler.kv_cache_manager.num_free_blocks == 1  # w would fit, but is not admitted
    assert [r.request_id for r in scheduler.waiting] == ["r2", "w"]


# -- admission: watermark and full_sequence_must_fit (scenario 18) ---------------------------


def test_watermark_refuses_an_admission_that_would_cross_it() -> None:
    scheduler = make_scheduler(num_blocks=10, watermark=0.2)  # 9 usable, watermark 2 blocks
    assert scheduler.watermark_blocks == 2
    scheduler.add_request(make_request("r1", tokens(0, 70)))  # 5 blocks, 4 left
    scheduler.add_request(make_request("r2", tokens(100, 40)))  # 3 blocks: would leave 1 < 2
    scheduler.add_request(make_request("r3", tokens(200, 20)))  # FCFS: waits behind r2
    assert step(scheduler).num_scheduled_tokens == {"r1": 70}

    scheduler = make_scheduler(num_blocks=10, watermark=0.2)
    scheduler.add_request(make_request("r1", tokens(0, 70)))
    scheduler.add_request(make_request("r2", tokens(100, 30)))  # 2 blocks: leaves exactly 2
    assert step(scheduler).num_scheduled_tokens == {"r1": 70, "r2": 30}


def test_watermark_never_refuses_the_sole_request() -> None:
    scheduler = make_scheduler(num_blocks=10, watermark=0.2)
    scheduler.add_request(make_request("r", tokens(0, 144), max_tokens=1))  # all 9 blocks
    assert step(scheduler).num_scheduled_tokens == {"r": 144}


def test_full_sequence_must_fit() -> None:
    scheduler = make_scheduler(num_blocks=10, full_sequence_must_fit=True)  # 9 usable blocks
    with pytest.raises(ValueError, match="needs 14 KV blocks"):
        scheduler.add_request(make_request("huge", tokens(0, 20), max_tokens=200))
    scheduler.add_request(make_request("a", tokens(0, 20), max_tokens=100))  # 8 of 9 blocks
    scheduler.add_request(make_request("b", tokens(100, 20), max_tokens=100))  # 8 of 7: no
    output = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 20}
    assert output.scheduled_new_reqs[0].block_ids == [1, 2]  # only the prompt's blocks

    plain = make_scheduler(num_blocks=10)
    plain.add_request(make_request("a", tokens(0, 20), max_tokens=100))
    plain.add_request(make_request("b", tokens(100, 20), max_tokens=100))
    assert step(plain).num_scheduled_tokens == {"a": 20, "b": 20}


def test_a_prompt_larger_than_the_whole_cache_is_rejected() -> None:
    scheduler = make_scheduler(num_blocks=3)
    with pytest.raises(ValueError, match="needs 3 KV blocks"):
        scheduler.add_request(make_request("r", tokens(0, 40)))


# -- output contents (scenario 33) ---------------------------------------------------------


def test_outputs_send_new_requests_in_full_and_running_ones_as_deltas() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", tokens(0, 31), max_tokens=5))
    first = step(scheduler, 9)
    (new,) = first.scheduled_new_reqs
    assert (new.req_id, new.prompt_token_ids, new.output_token_ids) == ("a", tokens(0, 31), [])
    assert (new.block_ids, new.num_computed_tokens) == ([1, 2], 0)
    assert first.new_block_ids_to_zero == [1, 2]

    second = step(scheduler, 9)
    cached = second.scheduled_cached_reqs
    # The runner keeps the tokens it samples: none come back through the scheduler.
    assert (cached.req_ids, cached.new_token_ids) == (["a"], [])
    assert (cached.new_block_ids, cached.num_computed_tokens) == ([[]], [31])
    assert second.new_block_ids_to_zero == []

    third = step(scheduler, 9)  # token 32 needs a third block
    assert third.scheduled_cached_reqs.new_block_ids == [[3]]
    assert third.new_block_ids_to_zero == [3]
    assert third.scheduled_cached_reqs.num_computed_tokens == [32]


def test_a_pipeline_gets_the_tokens_each_running_request_gained_since_it_was_last_sent() -> None:
    # The stages of a pipeline before the last sample nothing: they learn the tokens here.
    scheduler = make_scheduler(send_sampled_tokens=True)
    scheduler.add_request(make_request("a", tokens(0, 31), max_tokens=5))
    scheduler.add_request(make_request("b", tokens(100, 3), max_tokens=5))
    step(scheduler, {"a": 9, "b": 4})
    cached = step(scheduler, {"a": 8, "b": 5}).scheduled_cached_reqs
    assert (cached.req_ids, cached.new_token_ids) == (["a", "b"], [[9], [4]])
    cached = step(scheduler, {"a": 8, "b": 5}).scheduled_cached_reqs
    assert (cached.req_ids, cached.new_token_ids) == (["a", "b"], [[8], [5]])


def test_empty_step_when_nothing_is_waiting() -> None:
    scheduler = make_scheduler()
    output = scheduler.schedule()
    assert output.is_empty and output.finished_req_ids == set()
    assert scheduler.update_from_output(output, ModelRunnerOutput.empty()) == []


# -- stop conditions --------------------------------------------------------------------------


def run(scheduler: Scheduler, request: Request, token_id: int = 7) -> list[EngineCoreOutput]:
    scheduler.add_request(request)
    results: list[EngineCoreOutput] = []
    for _ in range(50):
        output = scheduler.schedule()
        results += scheduler.update_from_output(output, runner_output(scheduler, output, token_id))
        if request.request_id not in scheduler.requests:
            return results
    raise AssertionError("request did not finish")


def test_eos_stops_unless_ignored() -> None:
    results = run(make_scheduler(), make_request("r", [1, 2], eos_token_ids=(7,)))
    assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in results] == [
        ([7], "stop", None)
    ]
    request = make_request("r", [1, 2], max_tokens=3, eos_token_ids=(7,), ignore_eos=True)
    results = run(make_scheduler(), request)
    assert [o.finish_reason for o in results] == [None, None, "length"]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_every_eos_id_stops() -> None:
    # Llama 3 style: end of turn and end of text both end a request (not only the first id).
    for token_id in (7, 9):
        results = run(make_scheduler(), make_request("r", [1, 2], eos_token_ids=(7, 9)), token_id)
        assert [(o.new_token_ids, o.finish_reason) for o in results] == [([token_id], "stop")]


def test_min_tokens_delays_eos_and_stop_tokens() -> None:
    request = make_request("r", [1, 2], eos_token_ids=(7,), min_tokens=3)
    results = run(make_scheduler(), request)
    assert [o.finish_reason for o in results] == [None, None, "stop"]
    request = make_request("r", [1, 2], max_tokens=2, stop_token_ids=[7], min_tokens=2)
    assert run(make_scheduler(), request)[-1].stop_reason == 7


def test_stop_token_sets_stop_reason_and_eos_wins_over_length() -> None:
    results = run(make_scheduler(), make_request("r", [1, 2], stop_token_ids=[7]))
    assert (results[-1].finish_reason, results[-1].stop_reason) == ("stop", 7)
    request = make_request("r", [1, 2], max_tokens=1, eos_token_ids=(7,))
    assert run(make_scheduler(), request)[-1].finish_reason == "stop"


def test_max_model_len_caps_the_sequence() -> None:
    scheduler = make_scheduler(max_model_len=34)
    request = make_request("r", tokens(0, 32), max_tokens=None)
    results = run(scheduler, request)
    assert [o.finish_reason for o in results] == [None, "length"]
    assert request.num_tokens == 34


def test_a_sequence_may_not_outgrow_the_kv_cache() -> None:
    scheduler = make_scheduler(num_blocks=3)  # 2 usable blocks = 32 tokens
    request = make_request("r", tokens(0, 30), max_tokens=10)
    results = run(scheduler, request)
    assert [o.finish_reason for o in results] == [None, "length"]
    assert request.num_tokens == 32 and scheduler.make_stats().num_preemptions == 0


def test_tokens_after_a_stop_are_dropped_with_their_logprobs() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [1, 2], stop_token_ids=[9], logprobs=0))
    output = scheduler.schedule()
    logprobs = LogprobsLists([[5], [9], [6]], [[-0.1], [-0.2], [-0.3]], [1, 1, 1])
    runner = ModelRunnerOutput(["r"], [[5, 9, 6]], logprobs={"r": logprobs})
    (result,) = scheduler.update_from_output(output, runner)
    assert (result.new_token_ids, result.finish_reason, result.stop_reason) == ([5, 9], "stop", 9)
    assert result.new_logprobs == LogprobsLists([[5], [9]], [[-0.1], [-0.2]], [1, 1])
    assert scheduler.schedule().finished_req_ids == {"r"}
    assert scheduler.kv_cache_manager.num_free_blocks == 10


# -- abort and resubmit (scenario 34) -------------------------------------------------------


def test_abort_then_resubmit_under_the_same_id_completes() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", tokens(0, 20), max_tokens=3))
    step(scheduler)
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a", tokens(0, 20)))
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)  # ignored
    scheduler.check_invariants()
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 10

    scheduler.add_request(make_request("a", tokens(50, 20), max_tokens=3))
    output = step(scheduler)
    assert output.finished_req_ids == {"a"}  # the runner drops the old "a" first
    assert [n.req_id for n in output.scheduled_new_reqs] == ["a"]
    results = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        results += scheduler.update_from_output(output, runner_output(scheduler, output))
    assert results[-1].finish_reason == "length"
    assert scheduler.get_num_unfinished_requests() == 0


def test_abort_a_waiting_request_and_reject_bad_status() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", [1, 2]))
    scheduler.add_request(make_request("b", [3, 4]))
    step(scheduler)
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    scheduler.check_invariants()
    assert scheduler.make_stats().num_waiting_reqs == 0
    with pytest.raises(ValueError, match="finished_status"):
        scheduler.finish_requests("a", RequestStatus.RUNNING)


def test_outputs_of_a_request_aborted_after_scheduling_are_dropped() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2]))
    output = scheduler.schedule()
    runner = runner_output(scheduler, output)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.update_from_output(output, runner) == []


# -- queues and stats ---------------------------------------------------------------------


def test_request_queues_order_and_prepend() -> None:
    a = make_request("a", [1], priority=1, arrival_time=0.0)
    b = make_request("b", [1], priority=0, arrival_time=1.0)
    c = make_request("c", [1], priority=0, arrival_time=2.0)
    fcfs = FCFSRequestQueue()
    for r in (a, b):
        fcfs.add(r)
    fcfs.prepend(c)
    assert [r.request_id for r in fcfs] == ["c", "a", "b"]
    fcfs.remove(a)
    assert (fcfs.pop().request_id, len(fcfs)) == ("c", 1)

    prio = PriorityRequestQueue()
    for r in (a, c, b):
        prio.add(r)
    assert [r.request_id for r in prio] == ["b", "c", "a"]
    prio.remove(c)
    prio.prepend(c)
    assert prio.peek().request_id == "b"
    assert [prio.pop().request_id for _ in range(3)] == ["b", "c", "a"]
    with pytest.raises(IndexError):
        prio.peek()
    with pytest.raises(ValueError, match="not in the queue"):
        prio.remove(a)


def test_stats_reflect_the_scheduler_state() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", tokens(0, 20)))
    scheduler.add_request(make_request("b", tokens(100, 20)))
    step(scheduler)
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == 0.2
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions) == (
        20,
        0,
        0,
    )
