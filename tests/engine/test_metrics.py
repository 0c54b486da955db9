"""`EngineMetrics` (vLLM names, per-app registry) and the one-line stats log."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from fleetserve.engine.core.outputs import SchedulerStats
from fleetserve.engine.metrics import EngineMetrics, StatsLogger


def _value(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "m"})


def test_cumulative_stats_become_counter_increments() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m")
    metrics.record_scheduler_stats(SchedulerStats(3, 2, 0.5, 100, 40, 1))
    metrics.record_scheduler_stats(SchedulerStats(1, 0, 0.25, 160, 70, 1))
    assert _value(registry, "vllm:num_requests_running") == 1
    assert _value(registry, "vllm:num_requests_waiting") == 0
    assert _value(registry, "vllm:kv_cache_usage_perc") == 0.25
    assert _value(registry, "vllm:prefix_cache_queries_total") == 160
    assert _value(registry, "vllm:prefix_cache_hits_total") == 70
    assert _value(registry, "vllm:num_preemptions_total") == 1
    # A reset of the core's counts never decrements a counter.
    metrics.record_scheduler_stats(SchedulerStats(0, 0, 0.0, 10, 5, 0))
    assert _value(registry, "vllm:prefix_cache_queries_total") == 160


def test_registries_are_independent_and_export_every_name() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    EngineMetrics(first, "m").prompt_tokens.inc(5)
    EngineMetrics(second, "m")
    assert _value(first, "vllm:prompt_tokens_total") == 5
    assert _value(second, "vllm:prompt_tokens_total") == 0
    text = generate_latest(first).decode()
    for name in ("vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
                 "vllm:request_queue_time_seconds_count"):  # fmt: skip
        assert name in text, name


def test_stats_line_rates_and_hit_rate() -> None:
    logger = StatsLogger(last_log_time=100.0)
    assert logger.is_idle
    logger.last_stats = SchedulerStats(2, 1, 0.125, 200, 50, 0)
    logger.record_tokens(300, 40)
    line = logger.make_line(now=110.0)
    assert line == (
        "running: 2 reqs, waiting: 1 reqs, KV cache usage: 12.5%, prefix cache hit rate: 25.0%, "
        "prompt throughput: 30.0 tokens/s, generation throughput: 4.0 tokens/s"
    )
    logger.last_stats = SchedulerStats(0, 0, 0.0, 300, 150, 0)
    assert "prefix cache hit rate: 100.0%" in logger.make_line(now=120.0)
    assert logger.is_idle
