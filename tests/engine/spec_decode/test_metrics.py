"""The vllm:spec_decode_* counters: declared once, exported only with speculative decoding."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from fleetserve.common.metric_names import SPEC_DECODE_METRICS
from fleetserve.engine.core.outputs import SchedulerStats
from fleetserve.engine.metrics import EngineMetrics, StatsLogger
from fleetserve.engine.spec_decode.stats import SpecDecodingStats


def test_counters_follow_the_cumulative_stats() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m", spec_decode=True)
    stats = SpecDecodingStats()
    stats.observe(3, 2)
    stats.observe(3, 0)
    for _ in range(2):  # cumulative: sending the same totals again adds nothing
        metrics.record_scheduler_stats(SchedulerStats(spec_decoding=stats.copy()))
    stats.observe(2, 2)
    metrics.record_scheduler_stats(SchedulerStats(spec_decoding=stats.copy()))
    text = generate_latest(registry).decode()
    for spec in SPEC_DECODE_METRICS:
        assert spec.sample_name in text, spec.name
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 8.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 4.0' in text
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert f'{per_pos}{{model_name="m",position="0"}} 2.0' in text
    assert f'{per_pos}{{model_name="m",position="1"}} 2.0' in text
    assert f'{per_pos}{{model_name="m",position="2"}} 0.0' in text


def test_an_engine_without_speculation_exports_none() -> None:
    registry = CollectorRegistry()
    EngineMetrics(registry, "m")
    assert "spec_decode" not in generate_latest(registry).decode()


def test_the_stats_line_reports_the_interval_acceptance_rate() -> None:
    logger = StatsLogger(last_log_time=0.0)
    stats = SpecDecodingStats()
    stats.observe(4, 3)
    logger.last_stats = SchedulerStats(spec_decoding=stats.copy())
    assert logger.make_line(now=1.0).endswith("draft acceptance rate: 75.0% of 4 draft tokens")
    stats.observe(4, 1)
    logger.last_stats = SchedulerStats(spec_decoding=stats.copy())
    assert logger.make_line(now=2.0).endswith("draft acceptance rate: 25.0% of 4 draft tokens")
    assert "draft" not in StatsLogger().make_line()
