"""The declared metric names are exactly what the engine exports."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from fleetserve.common.metric_names import ENGINE_METRICS
from fleetserve.engine.metrics import EngineMetrics


def test_engine_exports_exactly_the_declared_metrics() -> None:
    registry = CollectorRegistry()
    EngineMetrics(registry, "m")
    text = generate_latest(registry).decode()
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    # NOTE: the text format lists each counter's and histogram's creation time as a gauge.
    exported = {name for name in families if not name.endswith("_created")}
    assert exported == {spec.sample_name for spec in ENGINE_METRICS}
    for spec in ENGINE_METRICS:
        sample = spec.sample_name + ("_count" if spec.kind == "histogram" else "")
        assert f'{sample}{{model_name="m"}}' in text, spec


def test_an_engine_with_a_connector_also_exports_the_kv_transfer_metrics() -> None:
    from fleetserve.common.metric_names import KV_TRANSFER_METRICS
    from fleetserve.engine.core.outputs import SchedulerStats
    from fleetserve.engine.kv_transfer.stats import KVTransferStats

    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m", kv_transfer=True)
    stats = KVTransferStats(handshakes=2, lease_expirations=1, tokens_loaded=48)
    stats.observe(0.02, 1 << 20, 3)
    stats.count_failure("receive")
    for _ in range(2):  # cumulative counters: sending the same totals again adds nothing
        metrics.record_scheduler_stats(SchedulerStats(kv_transfer=stats.take()))
    text = generate_latest(registry).decode()
    for spec in KV_TRANSFER_METRICS:
        assert spec.name in text, spec.name
    assert 'fleetserve:kv_handshakes_total{model_name="m"} 2.0' in text
    assert 'fleetserve:kv_tokens_loaded_total{model_name="m"} 48.0' in text
    assert (
        'fleetserve:kv_transfers_total{model_name="m",outcome="failed",stage="receive"} 1.0' in text
    )
    assert 'fleetserve:kv_transfers_total{model_name="m",outcome="ok",stage=""} 1.0' in text
    assert 'fleetserve:kv_transfer_seconds_count{model_name="m"} 1.0' in text
