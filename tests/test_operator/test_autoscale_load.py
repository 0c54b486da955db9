"""What the autoscaler reads from an engine's /metrics (fleetserve.operator.autoscale.load).

The exposition text comes from the engine's own metrics classes, so a renamed metric breaks
these tests, not only the autoscaler in a cluster.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fleetserve.engine.core.outputs import SchedulerStats
from fleetserve.engine.metrics import EngineMetrics
from fleetserve.operator.autoscale.load import (
    EngineCounters,
    engine_load,
    join_alive,
    parse_engine_metrics,
    parse_router_queue,
)
from tests.factories import make_request, make_scheduler, step


def test_the_scheduler_reports_the_prompt_tokens_still_to_compute() -> None:
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=32)
    sched.add_request(make_request("a", list(range(100))))
    sched.add_request(make_request("b", list(range(200, 250))))
    assert sched.make_stats().num_waiting_prompt_tokens == 150
    step(sched)  # a 32-token chunk of "a"
    assert sched.make_stats().num_waiting_prompt_tokens == 118


def _engine_text(stats: SchedulerStats, ttfts: list[float], itls: list[float], prompt: int) -> str:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m")
    metrics.record_scheduler_stats(stats)
    for t in ttfts:
        metrics.time_to_first_token.observe(t)
    for t in itls:
        metrics.inter_token_latency.observe(t)
    metrics.prompt_tokens.inc(prompt)
    return generate_latest(registry).decode()


def test_parse_reads_the_engines_own_exposition() -> None:
    stats = SchedulerStats(
        num_running_reqs=3, num_waiting_reqs=2, num_waiting_prompt_tokens=900, kv_cache_usage=0.4
    )
    text = _engine_text(stats, [0.5, 1.5], [0.02, 0.04], prompt=4000)
    c = parse_engine_metrics(text, time_s=10.0)
    assert (c.requests_running, c.requests_waiting, c.prompt_tokens_waiting) == (3, 2, 900)
    assert c.kv_usage == pytest.approx(0.4)
    assert (c.prompt_tokens, c.ttft_count, c.itl_count) == (4000, 2, 2)
    assert c.itl_sum == pytest.approx(0.06)


def test_rates_between_two_scrapes() -> None:
    before = EngineCounters(
        time_s=0, prompt_tokens=1000, ttft_count=1, prompt_tokens_waiting=2000, itl_count=10,
        itl_sum=0.2, prefix_queries=1000, prefix_hits=0,
    )  # fmt: skip
    after = EngineCounters(
        time_s=2, prompt_tokens=9000, ttft_count=5, prompt_tokens_waiting=6000, itl_count=30,
        itl_sum=1.2, prefix_queries=9000, prefix_hits=2000, kv_usage=0.5,
    )  # fmt: skip
    ld = engine_load(before, after)
    assert ld.prompt_tokens_per_s == 4000
    # 4000 tok/s finished and the backlog grew by 2000 tok/s: 6000 tok/s arrive.
    assert ld.prompt_tokens_arriving_per_s == 6000
    assert (ld.prompt_tokens_waiting_before, ld.interval_s) == (2000, 2)
    assert ld.mean_uncached_prompt_tokens == pytest.approx(2000 * 0.75)
    assert ld.mean_itl_s == pytest.approx(0.05)
    assert ld.kv_usage == 0.5


def test_a_restarted_engine_counts_from_zero_and_a_first_scrape_has_gauges_only() -> None:
    before = EngineCounters(time_s=0, prompt_tokens=10_000)
    after = EngineCounters(time_s=2, prompt_tokens=800, requests_running=1)
    assert engine_load(before, after).prompt_tokens_per_s == 400
    first = engine_load(None, after)
    assert first.prompt_tokens_per_s == 0 and first.requests_running == 1


def test_a_dead_pods_last_value_never_counts() -> None:
    loads = {"p0": engine_load(None, EngineCounters(0, prompt_tokens_waiting=10**6))}
    loads["p1"] = engine_load(None, EngineCounters(0, prompt_tokens_waiting=10))
    assert set(join_alive(loads, {"p1", "p2"})) == {"p1"}


def test_the_router_queue_depth() -> None:
    text = "# TYPE fleetserve:router_queue_depth gauge\nfleetserve:router_queue_depth 7.0\n"
    assert parse_router_queue(text) == 7
    with pytest.raises(ValueError):
        parse_engine_metrics("not { prometheus", 0)
